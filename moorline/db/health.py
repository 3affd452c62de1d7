"""Readiness of the database: can this process write to it right now?

``SELECT 1`` is not enough: a PostgreSQL hot standby, a database or role set to
``default_transaction_read_only``, a MySQL role without write grants or a read-only SQLite file
all answer reads while every run submission would fail. The probe therefore executes a real write
statement that matches no row, in a write transaction: the server checks read-only mode and
privileges before it looks for rows, so the probe fails exactly when writes do, yet it changes
nothing and takes no row lock. On SQLite the write transaction begins ``IMMEDIATE``, so the probe
also takes (and at once releases) the write lock.

It writes to ``tenants`` because that table always exists and nothing holds long table locks on
it; coordination tables such as ``leader_leases`` stay out of health checks.
"""

import asyncio
from typing import TYPE_CHECKING

from sqlalchemy import false, update
from sqlalchemy.exc import SQLAlchemyError

from moorline.db.failures import describe_db_error, permanent_reason
from moorline.db.schema import tenants
from moorline.errors import BackendUnavailable

if TYPE_CHECKING:
    from moorline.db.manager import DatabaseManager

PROBE_TIMEOUT_S = 5.0


async def check_writable(db: "DatabaseManager", *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Prove the database accepts writes from this process, changing nothing.

    Args:
        db: the database to probe.
        timeout_s: how long the probe may take, connecting included.

    Raises:
        BackendUnavailable: the database did not answer in time, or refused the write; the
            message is ``database is down: <reason>``.
    """
    probe = update(tenants).where(false()).values(name=tenants.c.name)
    try:
        async with asyncio.timeout(timeout_s):
            # Commits nothing: the statement matches no row.
            async with db.transaction() as conn:
                await conn.execute(probe)
    except TimeoutError:
        raise BackendUnavailable(f"database is down: no answer within {timeout_s:g}s") from None
    except BackendUnavailable as exc:  # no address accepted a connection
        raise BackendUnavailable(f"database is down: {exc.message}") from exc
    except (OSError, SQLAlchemyError) as exc:
        reason = permanent_reason(exc)
        why = describe_db_error(exc) if reason is None else f"{reason} ({describe_db_error(exc)})"
        raise BackendUnavailable(f"database is down: {why}") from exc
