"""The run filters shared by ``moorline runs`` and ``moorline bulk``: a created range and ids.

Times are read as typer reads them (RFC 3339 or ``YYYY-MM-DD[ HH:MM:SS]``); one without an
offset is UTC, as every time of the API is.
"""

from datetime import UTC, datetime
from typing import Annotated

import typer

CreatedAfter = Annotated[
    datetime | None,
    typer.Option(
        "--created-after",
        help="Only runs created at or after this time (RFC 3339, UTC if no offset).",
        show_default=False,
    ),
]
CreatedBefore = Annotated[
    datetime | None,
    typer.Option(
        "--created-before", help="Only runs created before this time.", show_default=False
    ),
]
Ids = Annotated[
    list[str] | None,
    typer.Option("--id", help="Only this run (repeat for more).", show_default=False),
]


def aware(moment: datetime | None) -> datetime | None:
    """A time given without an offset is UTC, as every time of the API is."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)
