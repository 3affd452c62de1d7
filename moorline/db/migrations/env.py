"""Alembic environment for PostgreSQL and MySQL/MariaDB.

``moorline.db.migrate`` runs Alembic's sync command API inside ``AsyncConnection.run_sync`` and
hands the (sync facade of the) connection over in ``config.attributes["connection"]``, so the
migrations use the DatabaseManager's engine, its failover creator and its DSN checks. Without a
connection (a developer calling ``alembic.command.revision(alembic_config(), autogenerate=True)``)
this module builds its own DatabaseManager from the ``MOORLINE_*`` environment.
"""

import asyncio
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy.engine import Connection
from sqlalchemy.types import TypeDecorator

from moorline.db.manager import DatabaseManager
from moorline.db.schema import metadata
from moorline.db.types import JSONDocument, UTCDateTime
from moorline.settings import load_settings

# Revisions are history, so they spell out the dialect types a decorator stands for today rather
# than importing the decorator: changing moorline.db.types later must not rewrite what an old
# revision creates. The compat test (upgrade == create_all) then shows the drift and asks for a
# new revision instead of letting existing databases silently differ from new ones.
FROZEN_TYPES: dict[type[TypeDecorator[Any]], tuple[str, str]] = {
    UTCDateTime: (
        'sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")',
        "from sqlalchemy.dialects import mysql",
    ),
    JSONDocument: (
        'sa.JSON().with_variant(postgresql.JSONB(), "postgresql")',
        "from sqlalchemy.dialects import postgresql",
    ),
}


def render_item(kind: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """Render Moorline's type decorators as the plain dialect types they stand for."""
    if kind != "type" or not isinstance(obj, TypeDecorator):
        return False
    if not type(obj).__module__.startswith("moorline."):
        return False
    frozen = FROZEN_TYPES.get(type(obj))
    if frozen is None:
        raise TypeError(
            f"{type(obj).__qualname__} has no frozen rendering: add it to FROZEN_TYPES in "
            "moorline/db/migrations/env.py"
        )
    rendered, import_line = frozen
    autogen_context.imports.add(import_line)
    return rendered


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_item=render_item,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_with_own_engine() -> None:
    db = DatabaseManager(load_settings())
    try:
        async with db.transaction() as conn:
            await conn.run_sync(run_migrations)
    finally:
        await db.dispose()


def run_migrations_offline() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    context.configure(
        url=url or load_settings().effective_database_urls[0],
        target_metadata=metadata,
        render_item=render_item,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run() -> None:
    connection: Connection | None = context.config.attributes.get("connection")
    if context.is_offline_mode():
        run_migrations_offline()
    elif connection is None:
        asyncio.run(run_migrations_with_own_engine())
    else:
        run_migrations(connection)


run()
