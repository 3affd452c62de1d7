"""The direct paths bind a statement's parameters exactly as SQLAlchemy's expansion does.

:func:`moorline.db.backends.direct.bound` lays the arguments out from the compiled form's slots
and keeps the expanded SQL per list lengths; SQLAlchemy's ``construct_expanded_state`` is the
reference. Compiled for each dialect the direct paths serve, no database needed.
"""

from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    bindparam,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

from moorline.db.backends.direct import _COMPILES_PER_SHAPE, Forms, _bound_by_sqlalchemy, bound
from moorline.db.types import UTCDateTime

metadata = MetaData()
marks = Table(
    "marks",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("owner", String(64)),
    Column("at", UTCDateTime()),
    Column("plain_at", DateTime()),
)

AT = datetime(2026, 11, 30, 13, 30, 1, 250000, tzinfo=UTC)

# A batch of fences (a finish's), between parameters of its own: numbered dialects put the
# list's members after every other parameter, positional ones in place.
FENCED = (
    update(marks)
    .where(
        tuple_(marks.c.id, marks.c.attempt, marks.c.owner).in_(bindparam("fences", expanding=True)),
        marks.c.attempt < bindparam("below"),
    )
    .values(owner=bindparam("new_owner"), at=bindparam("new_at"))
)
# Tuples whose elements have bind processors (SQLite writes times as text), beside a plain list.
TIMED = select(marks.c.id).where(
    tuple_(marks.c.id, marks.c.at, marks.c.plain_at).in_(bindparam("keys", expanding=True)),
    marks.c.attempt.in_(bindparam("attempts", expanding=True)),
)


def dialects() -> list[Dialect]:
    return [sqlite.dialect(), postgresql.asyncpg.dialect()]  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("dialect", dialects(), ids=lambda dialect: dialect.name)
@pytest.mark.parametrize(
    ("statement", "params"),
    [
        (
            FENCED,
            {
                "fences": [("a", 1, "w1"), ("b", 2, None), ("c", 3, "w3")],
                "below": 9,
                "new_owner": None,
                "new_at": AT,
            },
        ),
        (FENCED, {"fences": [("a", 1, "w1")], "below": 2, "new_owner": "w", "new_at": AT}),
        (
            TIMED,
            {
                "keys": [("a", AT, AT.replace(tzinfo=None)), ("b", None, None)],
                "attempts": [1, 2],
            },
        ),
        (TIMED, {"keys": [("c", AT, None)], "attempts": []}),
    ],
)
def test_tuple_in_lists_bind_as_sqlalchemys_expansion(
    dialect: Dialect, statement: Any, params: dict[str, Any]
) -> None:
    form = Forms(dialect).form(statement, params, False)
    assert form is not None and form.slots is not None, "a tuple list binds by its slots"
    for _ in range(2):  # the second time from the text kept for these lengths
        assert bound(form, params) == _bound_by_sqlalchemy(form, params)


@pytest.mark.parametrize("dialect", dialects(), ids=lambda d: d.name)
def test_statements_built_per_call_are_left_to_sqlalchemys_cache(dialect: Dialect) -> None:
    # A form binds the values written into its statement: each new object of one structure
    # would be compiled again. A few are; after them SQLAlchemy's cache (by structure) serves.
    forms = Forms(dialect)
    made = [
        forms.form(update(marks).where(marks.c.id == f"run-{n}").values(attempt=n), {}, False)
        for n in range(_COMPILES_PER_SHAPE + 2)
    ]
    assert all(form is not None for form in made[:_COMPILES_PER_SHAPE])
    assert made[_COMPILES_PER_SHAPE:] == [None, None]
    # Each compiled form binds its own object's values.
    first, second = made[0], made[1]
    assert first is not None and second is not None
    assert bound(first, {})[1] != bound(second, {})[1]
    # A statement built once keeps its form however often it runs, beside them.
    assert forms.form(FENCED, {"below": 1}, False) is forms.form(FENCED, {"below": 1}, False)
    # Another structure has its own count.
    assert forms.form(update(marks).where(marks.c.owner == "w").values(attempt=1), {}, False)
