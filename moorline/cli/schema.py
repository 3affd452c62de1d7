"""``moorline db upgrade``: bring the database schema to this version of Moorline."""

import asyncio
from typing import Annotated, Any

import typer
from rich.console import Console

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.settings import Settings, load_settings


def register(cli: typer.Typer) -> None:
    """Add ``db upgrade`` to the ``moorline`` command tree."""
    db_cli = typer.Typer(
        help="Manage the database schema.", no_args_is_help=True, rich_markup_mode="markdown"
    )
    db_cli.command("upgrade")(db_upgrade)
    cli.add_typer(db_cli, name="db")


def db_upgrade(
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help="Database to upgrade, instead of MOORLINE_DATABASE_URL(S).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Bring the database schema to this version of Moorline.

    PostgreSQL and MySQL/MariaDB are migrated with Alembic to the head revision; a SQLite
    database gets its tables created (it has no migrations).
    """
    overrides: dict[str, Any] = {}
    if database_url is not None:
        # An explicit URL wins over MOORLINE_DATABASE_URLS too, not only MOORLINE_DATABASE_URL.
        overrides = {"database_url": database_url, "database_urls": []}
    settings = load_settings(**overrides)
    display_url, revision = asyncio.run(_upgrade(settings))
    console = Console(soft_wrap=True, highlight=False)
    if revision is None:
        console.print(f"{display_url}: SQLite schema created (SQLite has no migrations)")
    else:
        console.print(f"{display_url}: schema at revision {revision} (head)")


async def _upgrade(settings: Settings) -> tuple[str, str | None]:
    db = DatabaseManager(settings)
    try:
        return db.display_url, await upgrade(db)
    finally:
        await db.dispose()
