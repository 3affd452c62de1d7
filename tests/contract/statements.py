"""Counting the SQL statements a piece of code sends, to pin how many round trips it costs."""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from moorline.db.manager import DatabaseManager

_DATA_STATEMENT = re.compile(r"^\s*(INSERT|UPDATE|SELECT|DELETE)\b", re.IGNORECASE)


@contextmanager
def data_statements(db: DatabaseManager, table: str) -> Iterator[list[str]]:
    """The INSERT/UPDATE/SELECT/DELETE statements naming ``table`` sent within the block.

    Transaction control (``BEGIN``, ``COMMIT``, isolation levels, pings) is not counted: it is
    the manager's business, not the caller's.
    """
    seen: list[str] = []
    name = re.compile(rf"\b{re.escape(table)}\b", re.IGNORECASE)

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _DATA_STATEMENT.match(statement) and name.search(statement):
            seen.append(statement)

    engines = [engine.sync_engine for engine in db.engines]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)
