"""The backend classes without a database: fragments built once, capabilities, error meanings."""

import pytest
from sqlalchemy import Integer, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from moorline.db.backends import backend_for
from moorline.db.backends.base import DialectName
from moorline.db.failures import as_unavailable, is_read_only_error
from moorline.db.schema import quota_usage, runs
from moorline.errors import BackendUnavailable

NAMES: tuple[DialectName, ...] = ("sqlite", "postgresql", "mysql")


@pytest.mark.parametrize("name", NAMES)
def test_time_fragments_are_built_once_per_offset(name: DialectName) -> None:
    # Shared by every backend object: a manager's and another's give the same expression.
    first, second = backend_for(name), backend_for(name)
    assert first.now() is second.now()
    assert first.now(plus_s=30) is second.now(plus_s=30.0)
    assert first.now(plus_s=30) is not first.now(plus_s=31)
    assert first.select_now() is second.select_now()


@pytest.mark.parametrize("name", NAMES)
def test_strategies_follow_the_capabilities(name: DialectName) -> None:
    backend = backend_for(name)
    can = backend.capabilities
    upsert = backend.increment_below(
        quota_usage, column="used", limit=3, keys={"tenant_id": "t", "day": "d"}
    )
    assert (upsert is not None) == can.upsert_returning
    assert (backend.transaction_time() is not None) == can.one_statement_submit
    assert (backend.rows_parameter("rows", {"n": Integer()}) is not None) == (
        can.one_statement_submit
    )
    assert (backend.write_isolation_level is not None) == can.row_locks
    locked = backend.lock_rows_skip_locked(select(runs.c.id))
    assert (locked._for_update_arg is not None) == can.skip_locked
    assert can.migrations == can.server


def test_the_sqlite_backend_keeps_no_wal_until_it_has_a_file() -> None:
    assert backend_for("sqlite").wal_bytes() is None
    assert backend_for("postgresql").wal_bytes() is None


def test_outages_become_backend_unavailable_and_bugs_do_not() -> None:
    lost = OperationalError("SELECT 1", {}, ConnectionResetError("gone"))
    assert isinstance(as_unavailable(lost), BackendUnavailable)
    assert isinstance(as_unavailable(PoolTimeoutError("no connection")), BackendUnavailable)
    duplicate = IntegrityError("INSERT", {}, ValueError("duplicate key"))
    assert as_unavailable(duplicate) is None
    assert as_unavailable(ValueError("a bug")) is None


def test_read_only_errors_are_recognised_on_both_servers() -> None:
    class PgError(Exception):
        sqlstate = "25006"

    assert is_read_only_error(PgError())
    assert is_read_only_error(Exception(1290, "--read-only"))
    assert not is_read_only_error(Exception(1062, "duplicate"))
