"""The migrations build exactly the schema of ``moorline.db.schema`` (PostgreSQL, MariaDB).

Upgrade-from-empty in one database and ``create_all`` in another must reflect identically, and
Alembic's own comparison against the metadata must find nothing to generate; downgrade returns
to an empty database; start refuses a database that is not at head with one exact line.
"""

import ast
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, make_url

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import (
    MIGRATIONS_DIR,
    alembic_config,
    current_revision,
    ensure_schema,
    head_revision,
    upgrade,
)
from moorline.db.schema import metadata
from moorline.errors import ConfigError, SchemaOutOfDate
from moorline.settings import Settings
from tests.servers import MYSQL_ADMIN_URL, PG_ADMIN_URL, require_server, run_sql, unique_name

Snapshot = dict[str, dict[str, Any]]


@pytest.fixture
def new_database(backend: str) -> Iterator[Callable[[], str]]:
    """Make empty databases on ``backend``'s server; each is dropped after the test."""
    require_server(backend)
    admin = PG_ADMIN_URL if backend == "postgresql" else MYSQL_ADMIN_URL
    created: list[str] = []

    def make() -> str:
        name = unique_name("moorline_mig")
        run_sql(backend, f"CREATE DATABASE {name}")
        created.append(name)
        return make_url(admin).set(database=name).render_as_string(hide_password=False)

    yield make
    force = " WITH (FORCE)" if backend == "postgresql" else ""
    for name in created:
        run_sql(backend, f"DROP DATABASE IF EXISTS {name}{force}")


@pytest.fixture
async def open_db() -> AsyncIterator[Callable[[str], DatabaseManager]]:
    """Open DatabaseManagers by URL; all are disposed after the test."""
    managers: list[DatabaseManager] = []

    def open_url(url: str) -> DatabaseManager:
        manager = DatabaseManager(Settings(database_url=url, db_retry_base=0.01))
        managers.append(manager)
        return manager

    yield open_url
    for manager in managers:
        await manager.dispose()


def out_of_date_message(current: str) -> str:
    return f"schema is at {current}, code needs {head_revision()}: run `moorline db upgrade`"


def snapshot(conn: Connection) -> Snapshot:
    """Everything reflection tells about the schema, in a comparable form."""
    insp = inspect(conn)
    tables: Snapshot = {}
    for name in sorted(set(insp.get_table_names()) - {"alembic_version"}):
        tables[name] = {
            "columns": [
                (
                    col["name"],
                    str(col["type"].compile(dialect=conn.dialect)),
                    col["nullable"],
                    col.get("default"),
                    col.get("autoincrement"),
                )
                for col in insp.get_columns(name)
            ],
            "primary_key": insp.get_pk_constraint(name),
            "foreign_keys": sorted(
                (
                    fk["name"] or "",
                    tuple(fk["constrained_columns"]),
                    fk["referred_table"],
                    tuple(fk["referred_columns"]),
                    tuple(sorted(fk.get("options", {}).items())),
                )
                for fk in insp.get_foreign_keys(name)
            ),
            "indexes": sorted(
                (
                    ix["name"] or "",
                    tuple(str(c) for c in ix["column_names"]),
                    ix["unique"],
                    str(ix.get("dialect_options", {}).get("postgresql_where")),
                )
                for ix in insp.get_indexes(name)
            ),
            "unique_constraints": sorted(
                (uq["name"] or "", tuple(uq["column_names"]))
                for uq in insp.get_unique_constraints(name)
            ),
            "check_constraints": sorted(
                (ck["name"] or "", ck["sqltext"]) for ck in insp.get_check_constraints(name)
            ),
        }
    return tables


def metadata_diffs(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(
        conn, opts={"compare_type": True, "compare_server_default": True}
    )
    return list(compare_metadata(context, metadata))


def table_names(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


async def downgrade_to_base(db: DatabaseManager) -> None:
    async with db.transaction() as conn:
        await conn.run_sync(lambda sync: command.downgrade(alembic_config(sync), "base"))


@pytest.mark.requires("server")
async def test_upgrade_from_empty_equals_create_all(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager]
) -> None:
    migrated = open_db(new_database())
    created = open_db(new_database())

    assert await upgrade(migrated) == head_revision()
    async with created.transaction() as conn:
        await conn.run_sync(metadata.create_all)

    async with migrated.connect() as conn:
        assert await conn.run_sync(metadata_diffs) == []
        migrated_schema = await conn.run_sync(snapshot)
    async with created.connect() as conn:
        assert await conn.run_sync(metadata_diffs) == []
        created_schema = await conn.run_sync(snapshot)

    assert set(migrated_schema) == set(metadata.tables)
    assert migrated_schema == created_schema


PARTIAL_RUN_INDEXES = {
    "ix_runs_parent": "parent_run_id",
    "ix_runs_conversation": "conversation_id",
    "ix_runs_lease": "lease_expires_at",
    "ix_runs_finished": "finished_at",
}


@pytest.mark.requires("server")
async def test_run_indexes_leave_out_null_rows_where_the_database_can(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager], backend: str
) -> None:
    # PostgreSQL: partial, as the schema says (0016); MariaDB has no partial indexes.
    db = open_db(new_database())
    await upgrade(db)
    async with db.connect() as conn:
        indexes = await conn.run_sync(lambda sync: inspect(sync).get_indexes("runs"))
    where = {ix["name"]: ix.get("dialect_options", {}).get("postgresql_where") for ix in indexes}
    for name, column in PARTIAL_RUN_INDEXES.items():
        if backend == "postgresql":
            assert where[name] == f"({column} IS NOT NULL)", (name, where[name])
        else:
            assert where[name] is None, (name, where[name])
    assert where["ix_runs_lane_tenant"] is None


@pytest.mark.requires("server")
async def test_constraint_names_follow_the_naming_convention(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager]
) -> None:
    db = open_db(new_database())
    await upgrade(db)
    async with db.connect() as conn:
        schema = await conn.run_sync(snapshot)
    for table in metadata.sorted_tables:
        reflected = schema[table.name]
        index_names = {name for name, _, _, _ in reflected["indexes"]}
        assert {str(ix.name) for ix in table.indexes} <= index_names
        unique_names = {name for name, _ in reflected["unique_constraints"]} | index_names
        expected_uniques = {
            str(c.name)
            for c in table.constraints
            if c.__visit_name__ == "unique_constraint"  # UniqueConstraint, not PK or FK
        }
        assert expected_uniques <= unique_names
        assert {str(fk.name) for fk in table.foreign_key_constraints} == {
            name for name, *_ in reflected["foreign_keys"]
        }


@pytest.mark.requires("server")
async def test_downgrade_to_base_and_back(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager]
) -> None:
    db = open_db(new_database())
    await upgrade(db)

    await downgrade_to_base(db)
    async with db.connect() as conn:
        assert await conn.run_sync(table_names) == {"alembic_version"}
    assert await current_revision(db) is None
    with pytest.raises(SchemaOutOfDate) as behind:
        await ensure_schema(db)
    assert str(behind.value) == out_of_date_message("empty")

    assert await upgrade(db) == head_revision()
    await ensure_schema(db)


@pytest.mark.requires("server")
async def test_ensure_schema_refuses_an_empty_database_in_one_line(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager]
) -> None:
    db = open_db(new_database())
    with pytest.raises(SchemaOutOfDate) as empty:
        await ensure_schema(db)
    assert str(empty.value) == out_of_date_message("empty")
    assert "\n" not in str(empty.value)
    # The check only reads: it must not have created anything.
    async with db.connect() as conn:
        assert await conn.run_sync(table_names) == set()


@pytest.mark.requires("server")
async def test_ensure_schema_passes_at_head_and_upgrade_is_idempotent(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager]
) -> None:
    db = open_db(new_database())
    assert await upgrade(db) == head_revision()
    assert await upgrade(db) == head_revision()
    await ensure_schema(db)
    await db.initialize()
    assert await current_revision(db) == head_revision()


@pytest.mark.requires("server")
async def test_ensure_schema_names_a_revision_the_code_does_not_know(
    new_database: Callable[[], str], open_db: Callable[[str], DatabaseManager]
) -> None:
    db = open_db(new_database())
    await upgrade(db)
    async with db.transaction() as conn:
        await conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
    with pytest.raises(ConfigError) as unknown:
        await ensure_schema(db)
    assert not isinstance(unknown.value, SchemaOutOfDate)
    assert str(unknown.value).startswith("schema is at f00dfeed, which this code does not know")


def test_revisions_spell_out_dialect_types() -> None:
    # Revisions are history: importing moorline's type decorators would let a later change
    # to them rewrite what an old revision creates (see migrations/env.py).
    revisions = sorted((MIGRATIONS_DIR / "versions").glob("[0-9]*.py"))
    assert revisions
    for path in revisions:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {name for name in imported if name.split(".")[0] == "moorline"}, path.name
