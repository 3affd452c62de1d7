"""Column types: aware UTC datetimes everywhere (microseconds on MySQL too) and JSON."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine


class UTCDateTime(TypeDecorator[datetime]):
    """An aware UTC ``datetime`` in Python; UTC in the database.

    PostgreSQL stores ``timestamptz``; MySQL/MariaDB ``DATETIME(6)`` holding UTC; SQLite the
    ISO text SQLAlchemy writes (``YYYY-MM-DD HH:MM:SS.ffffff``), which sorts as time does.
    Naive datetimes are refused on the way in so local time can never sneak into a row.
    """

    impl = DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.TIMESTAMP(timezone=True))
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: Moorline stores aware UTC datetimes")
        value = value.astimezone(UTC)
        if dialect.name == "postgresql":
            return value
        return value.replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # SQLite expressions (database time) come back as text
            value = datetime.fromisoformat(value)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)  # type: ignore[no-any-return]
        return value.astimezone(UTC)  # type: ignore[no-any-return]


class JSONDocument(TypeDecorator[Any]):
    """JSON on every backend (``jsonb`` on PostgreSQL, ``JSON``/``LONGTEXT`` elsewhere)."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSONB())
        return dialect.type_descriptor(JSON())


def utcnow() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)
