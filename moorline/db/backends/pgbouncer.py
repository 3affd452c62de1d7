"""PostgreSQL behind PgBouncer in transaction pooling mode: no session state relied on.

With ``pool_mode = transaction`` PgBouncer lends a server session to a client for one
transaction (or one statement outside a transaction) and may give the next one another
session, so nothing a session keeps between transactions may be relied on:

- Prepared statements. asyncpg names and caches one per query by default; on another server
  session the name is missing, or already taken by another client's statement. With
  ``statement_cache_size=0`` asyncpg (0.29 or later) prepares *unnamed* statements only and
  sends each one's ``Parse`` again with its ``Bind``/``Execute``/``Sync``, because PgBouncer
  may take the ``Flush`` after a describe for a transaction's end (asyncpg #1065). SQLAlchemy's
  asyncpg adapter prepares through asyncpg without a name of its own, so its statements are
  unnamed too: nothing is left on a server session, nothing can collide. (SQLAlchemy's docs
  suggest unique names instead; named statements would pile up on the server sessions until
  PgBouncer closes them.) Its cache of prepared statements is kept: what it holds is
  client-side only (the result's columns), and it saves the describe round trip.
  PgBouncer 1.21 can track named protocol-level prepared statements itself
  (``max_prepared_statements``); Debian 12's PgBouncer is 1.18, so this does not rely on it.
- ``LISTEN``: a listener must stay on one session; :attr:`Capabilities.session_state` is
  false, and the wake-ups listen over ``MOORLINE_LISTEN_URL`` (a direct URL) or poll.
- Session ``SET``, advisory locks, temporary tables: Moorline uses none on PostgreSQL (the
  write isolation level goes in each ``BEGIN``: asyncpg's transactions are client-side).
"""

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from moorline.db.backends.base import Capabilities, Pools
from moorline.db.backends.postgresql import PostgreSQLBackend
from moorline.db.dsn import ConnectTarget
from moorline.settings import Settings


class PgBouncerBackend(PostgreSQLBackend):
    """PostgreSQL reached through PgBouncer: the same SQL, no session state."""

    capabilities: ClassVar[Capabilities] = dataclasses.replace(
        PostgreSQLBackend.capabilities, session_state=False
    )

    def create_pools(self, settings: Settings, url: str, targets: Sequence[ConnectTarget]) -> Pools:
        return super().create_pools(settings, url, [unprepared(target) for target in targets])


def unprepared(target: ConnectTarget) -> ConnectTarget:
    """``target`` whose asyncpg connections prepare unnamed statements only (see above)."""
    return dataclasses.replace(target, kwargs={**target.kwargs, "statement_cache_size": 0})
