"""Schema creation (SQLite) and the version check and upgrade (PostgreSQL, MySQL/MariaDB).

SQLite has no migrations: ``create_all`` builds the schema from :mod:`moorline.db.schema` at start.
PostgreSQL and MySQL/MariaDB reach the same schema through the Alembic revisions in
``moorline/db/migrations``, applied by ``moorline db upgrade``; start refuses a database whose
``alembic_version`` is not the code's head revision.

Alembic's command API is synchronous, so it runs inside ``AsyncConnection.run_sync`` and receives
the connection through ``config.attributes["connection"]`` (see ``migrations/env.py``). The
``Config`` is built here rather than read from an ``alembic.ini``, so nothing depends on the
working directory.

To write a new revision, point ``MOORLINE_DATABASE_URL`` at a PostgreSQL database at head and run::

    python -c 'from alembic import command; from moorline.db.migrate import alembic_config;
    command.revision(alembic_config(), "what changed", autogenerate=True, rev_id="0002")'
"""

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Protocol

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.failures import describe_db_error, is_transient
from moorline.db.schema import metadata
from moorline.errors import BackendUnavailable, ConfigError, SchemaOutOfDate

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


class Database(Protocol):
    """What migrating needs of a :class:`~moorline.db.manager.DatabaseManager`.

    A protocol rather than the manager itself, which calls :func:`ensure_schema` at start:
    naming the manager here would make the two modules import each other.
    """

    @property
    def backend(self) -> Backend: ...

    @property
    def display_url(self) -> str: ...

    def connect(self) -> AbstractAsyncContextManager[AsyncConnection]: ...

    def transaction(self) -> AbstractAsyncContextManager[AsyncConnection]: ...


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic ``Config`` for Moorline's migrations, optionally bound to ``connection``.

    Args:
        connection: the sync connection env.py migrates on; ``None`` makes env.py build its
            own DatabaseManager from the ``MOORLINE_*`` environment.
    """
    config = Config()
    # ConfigParser interpolates '%', which may occur in an install path.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The revision the code needs: the single head of the migration history."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships its revisions
        raise ConfigError(f"no Alembic revisions found in {MIGRATIONS_DIR}")
    return head


def _known_revisions() -> set[str]:
    return {
        script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()
    }


def _read_revision(conn: Connection) -> str | None:
    # A MigrationContext without options only reads; it creates no version table.
    heads = MigrationContext.configure(conn).get_current_heads()
    return ",".join(heads) if heads else None


def _upgrade_to_head(conn: Connection) -> None:
    command.upgrade(alembic_config(conn), "head")


@asynccontextmanager
async def _reaching(db: Database) -> AsyncIterator[None]:
    """Turn a database that cannot be reached into one line instead of a driver traceback."""
    try:
        yield
    except (OSError, DBAPIError) as exc:
        if isinstance(exc, DBAPIError) and not is_transient(exc):
            raise
        reason = describe_db_error(exc)
        raise BackendUnavailable(f"database {db.display_url} is unreachable: {reason}") from exc


async def current_revision(db: Database) -> str | None:
    """The revision recorded in ``alembic_version``; ``None`` for an empty database.

    SQLite databases are never migrated, so they always answer ``None``.
    """
    async with _reaching(db), db.connect() as conn:
        return await conn.run_sync(_read_revision)


RETIRED_SQLITE_INDEXES = ("ix_runs_claim",)
"""Indexes older versions created and the schema no longer has (replaced by migration 0002)."""

ADDED_SQLITE_COLUMNS = (
    ("steps", "seq", "INTEGER"),
    ("runs", "waiting_for", "JSON"),
    ("runs", "wake_at", "DATETIME"),
    ("runs", "resumes", "INTEGER NOT NULL DEFAULT 0"),
    ("runs", "deadline_at", "DATETIME"),
    ("runs", "parent_run_id", "VARCHAR(36)"),
    ("runs", "child_key", "VARCHAR(255)"),
    ("runs", "depth", "INTEGER NOT NULL DEFAULT 0"),
    ("runs", "detached", "INTEGER NOT NULL DEFAULT 0"),
    ("runs", "awaited", "INTEGER NOT NULL DEFAULT 0"),
    ("runs", "emits", "INTEGER NOT NULL DEFAULT 0"),
    ("workers", "version", "VARCHAR(64)"),
    ("runs", "rerun_of", "VARCHAR(36)"),
    ("runs", "cached_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("runs", "cost", "FLOAT NOT NULL DEFAULT 0"),
    ("runs", "saved_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("runs", "saved_cost", "FLOAT NOT NULL DEFAULT 0"),
    ("steps", "usage", "JSON"),
)
"""Columns added since the first version (table, column, SQLite type), as the server
migrations add them (0004, 0005, 0008, 0010, 0011, 0013): ``create_all`` never alters a table that
exists."""


def _create_all_sqlite(conn: Connection) -> None:
    """Create missing tables, the columns and indexes added since; drop the retired indexes.

    ``create_all`` creates a table's indexes only with the table, so a database file made by an
    older version would never get a newer index: SQLite has no migrations to add it. An index
    whose columns changed since (``ix_runs_lane_tenant`` gained ``workflow`` in 0006), or that
    became partial (0016), is rebuilt, as the server migrations drop and create it.
    """
    metadata.create_all(conn)
    # Columns first: an index added since may be on one of them.
    for table_name, column, sql_type in ADDED_SQLITE_COLUMNS:
        present = {row[1] for row in conn.exec_driver_sql(f"PRAGMA table_info({table_name})")}
        if column not in present:
            conn.exec_driver_sql(f"ALTER TABLE {table_name} ADD COLUMN {column} {sql_type}")
    # Each stored index's definition, to tell a partial one (0016 made four so) from a whole.
    definitions: dict[str, str] = {
        name: sql
        for name, sql in conn.exec_driver_sql(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        )
    }
    for table in metadata.sorted_tables:
        for index in table.indexes:
            stored = [row[2] for row in conn.exec_driver_sql(f"PRAGMA index_info({index.name})")]
            partial = index.dialect_options["sqlite"]["where"] is not None
            if stored and (
                stored != [column.name for column in index.columns]
                or (" WHERE " in definitions.get(str(index.name), "").upper()) != partial
            ):
                conn.exec_driver_sql(f"DROP INDEX {index.name}")
            index.create(conn, checkfirst=True)
    for retired in RETIRED_SQLITE_INDEXES:
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {retired}")


async def ensure_schema(db: Database) -> None:
    """Create the schema on SQLite; elsewhere fail unless the migrations are at head.

    Raises:
        SchemaOutOfDate: the database is empty or behind the code's head revision.
        ConfigError: the database is at a revision this code does not know.
        BackendUnavailable: the database did not answer.
    """
    if not db.backend.capabilities.migrations:
        async with _reaching(db), db.transaction() as conn:
            await conn.run_sync(_create_all_sqlite)
        return
    head = head_revision()
    current = await current_revision(db)
    if current == head:
        return
    if current is not None and current not in _known_revisions():
        raise ConfigError(
            f"schema is at {current}, which this code does not know: "
            "the database was migrated by a newer Moorline"
        )
    raise SchemaOutOfDate(
        f"schema is at {current or 'empty'}, code needs {head}: run `moorline db upgrade`"
    )


async def upgrade(db: Database) -> str | None:
    """Bring the schema to the code's version (``moorline db upgrade``).

    Returns:
        The revision the database is now at, or ``None`` on SQLite, whose tables are created
        from the metadata instead of migrated.
    """
    if not db.backend.capabilities.migrations:
        await ensure_schema(db)
        return None
    # One transaction: PostgreSQL's DDL is transactional, so a failed upgrade leaves nothing
    # half-done there (MySQL commits each DDL statement implicitly; nothing can prevent that).
    async with _reaching(db), db.transaction() as conn:
        await conn.run_sync(_upgrade_to_head)
    return await current_revision(db)
