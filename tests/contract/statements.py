"""Counting the SQL statements a piece of code sends, to pin how many round trips it costs."""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from moorline.db.manager import DatabaseManager

_DATA_STATEMENT = re.compile(r"^\s*(WITH|INSERT|UPDATE|SELECT|DELETE)\b", re.IGNORECASE)


@contextmanager
def data_statements(db: DatabaseManager, table: str | None) -> Iterator[list[str]]:
    """The INSERT/UPDATE/SELECT/DELETE statements (or WITH …) naming ``table`` sent in the block.

    With ``table`` None, every such statement, whatever it names (a ``SELECT`` of the time).

    Transaction control (``BEGIN``, ``COMMIT``, isolation levels, pings) is not counted: it is
    the manager's business, not the caller's.
    """
    seen: list[str] = []
    name = None if table is None else re.compile(rf"\b{re.escape(table)}\b", re.IGNORECASE)

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _DATA_STATEMENT.match(statement) and (name is None or name.search(statement)):
            seen.append(statement)

    engines = [engine.sync_engine for engine in db.engines]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)
