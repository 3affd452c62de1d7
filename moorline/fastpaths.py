"""The private names of other libraries that Moorline's fast paths use, and their check.

A fast path is code that reaches into a dependency's internals to skip work its public API
does: aiosqlite's thread crossings (:mod:`moorline.db.sqlite_driver`), SQLAlchemy's execution
of SQLite's writes and of PostgreSQL's one-statement writes (:mod:`moorline.db.backends.direct`
and the modules it names), aiomysql's needless ``ROLLBACK`` and ping
(:mod:`moorline.db.mysql_driver`), the ``limits`` memory storage's sweep thread
(:mod:`moorline.admission.ratelimit`), Starlette's response construction and FastAPI's
dependency solving on the trigger route (:mod:`moorline.api.routes.trigger`,
:mod:`moorline.api.guards`). Each has a fallback to the library's public path, chosen by the
``fast_paths`` setting (``MOORLINE_FAST_PATHS``), the way uvicorn picks httptools or h11.

:data:`PRIVATE_NAMES` lists every private name those paths touch, with the shape the code
expects of it. ``pyproject.toml`` bounds each library below its next release and
``constraints.txt`` pins the tested versions, but a user can still install another: so a fast
path calls :func:`require` before it is first used, and ``tests/compat/test_private_names.py``
checks the whole list, both failing with one line that names the library, the name and the
setting that falls back, rather than with an ``AttributeError`` deep in a request.
"""

import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from moorline.errors import ConfigError


class Shape(StrEnum):
    """What the code expects a private name to be."""

    METHOD = "method"
    """A function on the class; ``details`` are its first parameters after ``self``."""
    ATTRIBUTE = "attribute"
    """Present on an instance built as the library builds it (``__init__``), or on the class."""
    KEYWORDS = "keywords"
    """A function that takes each of ``details`` as a keyword argument."""
    SOURCE = "source"
    """A function whose source holds each of ``details`` (a call the fast path relies on)."""
    INIT_SETS = "init_sets"
    """``__init__`` sets exactly the instance attributes ``details`` (a class the code builds
    without calling its ``__init__``, setting those attributes itself)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrivateName:
    """One private name of a dependency that a fast path touches.

    Attributes:
        library: The distribution (``pip`` name) that defines it.
        owner: The dotted path of the class (or module) that holds it.
        name: The attribute on that class (mangled names spelt mangled).
        shape: What the code expects it to be.
        details: Parameters, attributes or source fragments, per :class:`Shape`.
        user: The Moorline module whose fast path uses it.
    """

    library: str
    owner: str
    name: str
    shape: Shape
    details: tuple[str, ...] = ()
    user: str


_SQLITE = "moorline/db/sqlite_driver.py"
_MYSQL = "moorline/db/mysql_driver.py"
_RATELIMIT = "moorline/admission/ratelimit.py"
_TRIGGER = "moorline/api/routes/trigger.py"
_GUARDS = "moorline/api/guards.py"


def _sqlite(owner: str, name: str, shape: Shape, *details: str) -> PrivateName:
    return PrivateName(
        library="aiosqlite", owner=owner, name=name, shape=shape, details=details, user=_SQLITE
    )


_DIRECT = "moorline/db/backends/direct.py"
_SQLITE_DIRECT = "moorline/db/backends/sqlite_direct.py"
_PG_DIRECT = "moorline/db/backends/postgresql_direct.py"
_ASYNCPG_ADAPTER = "sqlalchemy.dialects.postgresql.asyncpg.AsyncAdapt_asyncpg_connection"


def _sqlalchemy_direct(
    owner: str, name: str, shape: Shape, *details: str, user: str = _SQLITE_DIRECT
) -> PrivateName:
    return PrivateName(
        library="sqlalchemy", owner=owner, name=name, shape=shape, details=details, user=user
    )


def _mysql(owner: str, name: str, shape: Shape, *details: str) -> PrivateName:
    return PrivateName(
        library="aiomysql", owner=owner, name=name, shape=shape, details=details, user=_MYSQL
    )


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # sqlite_driver.Connection subclasses aiosqlite's and reroutes its calls.
    _sqlite("aiosqlite.Connection", "__init__", Shape.METHOD, "connector", "iter_chunk_size"),
    _sqlite("aiosqlite.Connection", "_execute", Shape.METHOD, "fn"),
    _sqlite("aiosqlite.Connection", "_running", Shape.ATTRIBUTE),
    _sqlite("aiosqlite.Connection", "_connection", Shape.ATTRIBUTE),
    _sqlite("aiosqlite.Connection", "_thread", Shape.ATTRIBUTE),
    _sqlite("aiosqlite.Connection", "_iter_chunk_size", Shape.ATTRIBUTE),
    _sqlite("aiosqlite.Connection", "_conn", Shape.ATTRIBUTE),
    # sqlite_driver._Cursor replaces the sqlite3 cursor aiosqlite's methods read.
    _sqlite("aiosqlite.Cursor", "__init__", Shape.METHOD, "conn", "cursor"),
    _sqlite("aiosqlite.Cursor", "_execute", Shape.SOURCE, "self._conn._execute("),
    # mysql_driver.Connection reads the socket's state and the last result.
    _mysql("aiomysql.Connection", "_connect", Shape.METHOD),
    _mysql("aiomysql.Connection", "_result", Shape.ATTRIBUTE),
    _mysql("aiomysql.Connection", "_affected_rows", Shape.ATTRIBUTE),
    _mysql("aiomysql.Connection", "_reader", Shape.ATTRIBUTE),
    _mysql("aiomysql.Connection", "_writer", Shape.ATTRIBUTE),
    _mysql("aiomysql.connection._StreamReader", "eof_received", Shape.ATTRIBUTE),
    _mysql("aiomysql.connection.MySQLResult", "__init__", Shape.SOURCE, "self.has_next"),
    # dsn._connect bounds unacknowledged data on the drivers' sockets (TCP_USER_TIMEOUT).
    PrivateName(
        library="asyncpg",
        owner="asyncpg.connection.Connection",
        name="_transport",
        shape=Shape.ATTRIBUTE,
        user="moorline/db/dsn.py",
    ),
    # ratelimit.SweptMemoryStorage replaces the storage's sweep scheduling (name-mangled).
    PrivateName(
        library="limits",
        owner="limits.storage.MemoryStorage",
        name="_MemoryStorage__schedule_expiry",
        shape=Shape.METHOD,
        user=_RATELIMIT,
    ),
    PrivateName(
        library="limits",
        owner="limits.storage.MemoryStorage",
        name="_MemoryStorage__expire_events",
        shape=Shape.METHOD,
        user=_RATELIMIT,
    ),
    # trigger.TriggerAnswer is a Response built without Response.__init__.
    PrivateName(
        library="starlette",
        owner="starlette.responses.Response",
        name="__init__",
        shape=Shape.INIT_SETS,
        details=("background", "body", "raw_headers", "status_code"),
        user=_TRIGGER,
    ),
    # The backends' write_statement runs its sync body in one greenlet, as SQLAlchemy's
    # asyncio extension does (exported by sqlalchemy.util, but not documented).
    PrivateName(
        library="sqlalchemy",
        owner="sqlalchemy.util",
        name="greenlet_spawn",
        shape=Shape.KEYWORDS,
        details=("fn",),
        user="moorline/db/backends/ (sqlite.py, server.py)",
    ),
    # The direct paths send statements past SQLAlchemy unless the connection or engine has
    # cursor or error event listeners, which they read from the event dispatch, and build
    # their rows as SQLAlchemy's results do: from the compiler's record of the columns, on the
    # metadata of an in-memory result.
    _sqlalchemy_direct(
        "sqlalchemy.engine.Connection",
        "dispatch",
        Shape.ATTRIBUTE,
        user="moorline/db/backends/ (sqlite_direct.py, postgresql_direct.py)",
    ),
    _sqlalchemy_direct("sqlalchemy.engine.Dialect", "dispatch", Shape.ATTRIBUTE),
    _sqlalchemy_direct("sqlalchemy.engine.Engine", "dispatch", Shape.ATTRIBUTE, user=_PG_DIRECT),
    _sqlalchemy_direct(
        "sqlalchemy.sql.compiler.SQLCompiler", "_result_columns", Shape.ATTRIBUTE, user=_DIRECT
    ),
    # Forms counts the statements of one structure it compiled by their cache key, the key of
    # SQLAlchemy's own cache of compiled statements.
    _sqlalchemy_direct(
        "sqlalchemy.sql.elements.ClauseElement", "_generate_cache_key", Shape.METHOD, user=_DIRECT
    ),
    _sqlalchemy_direct(
        "sqlalchemy.engine.result.SimpleResultMetaData",
        "__init__",
        Shape.METHOD,
        "keys",
        "extra",
        "_processors",
        user=_DIRECT,
    ),
    # postgresql_direct runs a statement as SQLAlchemy's asyncpg cursor does (the adapter's
    # lock, its transaction begun by the first statement, its prepared-statement cache and
    # error translation), and invalidates the pool on a lost connection as SQLAlchemy's
    # execution does.
    _sqlalchemy_direct(
        _ASYNCPG_ADAPTER,
        "_prepare",
        Shape.METHOD,
        "operation",
        "invalidate_timestamp",
        user=_PG_DIRECT,
    ),
    _sqlalchemy_direct(_ASYNCPG_ADAPTER, "_execute_mutex", Shape.ATTRIBUTE, user=_PG_DIRECT),
    _sqlalchemy_direct(_ASYNCPG_ADAPTER, "_transaction", Shape.ATTRIBUTE, user=_PG_DIRECT),
    _sqlalchemy_direct(_ASYNCPG_ADAPTER, "_start_transaction", Shape.METHOD, user=_PG_DIRECT),
    _sqlalchemy_direct(
        _ASYNCPG_ADAPTER, "_handle_exception", Shape.METHOD, "error", user=_PG_DIRECT
    ),
    _sqlalchemy_direct(
        "sqlalchemy.pool.Pool",
        "_invalidate",
        Shape.METHOD,
        "connection",
        "exception",
        user=_PG_DIRECT,
    ),
    # guards.solved_by's route replaces the ASGI app FastAPI builds for an APIRoute.
    PrivateName(
        library="starlette",
        owner="starlette.routing.Route",
        name="handle",
        shape=Shape.SOURCE,
        details=("self.app(",),
        user=_GUARDS,
    ),
    PrivateName(
        library="fastapi",
        owner="fastapi.routing.APIRoute",
        name="get_route_handler",
        shape=Shape.METHOD,
        user=_GUARDS,
    ),
    PrivateName(
        library="fastapi",
        owner="fastapi.routing.APIRouter",
        name="add_api_route",
        shape=Shape.KEYWORDS,
        details=("route_class_override",),
        user=_TRIGGER,
    ),
)
"""Every private name of another library that a fast path touches."""


def _aiosqlite_connection(cls: type[Any]) -> Any:
    import sqlite3

    # Not awaited: its thread is created, not started.
    return cls(lambda: sqlite3.connect(":memory:"), iter_chunk_size=64)


def _aiomysql_connection(cls: type[Any]) -> Any:
    import asyncio

    # Given a loop of its own, or it would make one for the thread and leave it open.
    loop = asyncio.new_event_loop()
    try:
        return cls(loop=loop)
    finally:
        loop.close()


_PROBES: dict[str, Callable[[type[Any]], Any]] = {
    "aiosqlite.Connection": _aiosqlite_connection,
    "aiomysql.Connection": _aiomysql_connection,
    "starlette.responses.Response": lambda cls: cls(b""),
}
"""How to build an instance of an owner as its library would, to see its instance attributes."""


def _resolve(owner: str) -> type[Any]:
    module_name, _, class_name = owner.rpartition(".")
    cls: type[Any] = getattr(importlib.import_module(module_name), class_name)
    return cls


def _instance_of(owner: str, cls: type[Any]) -> Any:
    probe = _PROBES.get(owner)
    if probe is None:
        return None
    return probe(cls)


def mismatch(name: PrivateName) -> str | None:
    """How ``name`` differs from what the code expects, or None when it fits."""
    try:
        cls = _resolve(name.owner)
    except (ImportError, AttributeError):
        return f"no longer has {name.owner}"
    try:
        return _mismatch(name, cls)
    except Exception as exc:  # a probe or a signature that broke is a mismatch too
        reason = " ".join(str(exc).split())[:120]
        return f"has a {name.owner} that cannot be checked ({type(exc).__name__}: {reason})"


_ABSENT = object()


def _mismatch(name: PrivateName, cls: type[Any]) -> str | None:
    short = f"{name.owner.rpartition('.')[2]}.{name.name}"
    found = inspect.getattr_static(cls, name.name, _ABSENT)
    if name.shape is Shape.ATTRIBUTE:
        # A class attribute whose default is None (SQLAlchemy's Compiled._result_columns) is
        # there all the same.
        if found is _ABSENT and not hasattr(_instance_of(name.owner, cls), name.name):
            return f"no longer has {short}"
        return None
    if not callable(found):
        return f"no longer has {short}"
    if name.shape is Shape.METHOD:
        parameters = list(inspect.signature(found).parameters)[1:]
        if parameters[: len(name.details)] != list(name.details):
            return f"has {short}({', '.join(parameters)}), not ({', '.join(name.details)}, ...)"
    elif name.shape is Shape.KEYWORDS:
        lacking = [word for word in name.details if word not in inspect.signature(found).parameters]
        if lacking:
            return f"has {short} without its {lacking[0]} argument"
    elif name.shape is Shape.SOURCE:
        source = inspect.getsource(found)
        lacking = [fragment for fragment in name.details if fragment not in source]
        if lacking:
            return f"has {short} without {lacking[0]!r}"
    else:
        attributes = sorted(vars(_instance_of(name.owner, cls)))
        if attributes != sorted(name.details):
            return f"has {short} setting {attributes}, not {sorted(name.details)}"
    return None


def describe(name: PrivateName, problem: str) -> str:
    """The one-line message for ``name`` not fitting: library, name, and the way out."""
    try:
        version = importlib.metadata.version(name.library)
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    return (
        f"{name.library} {version} {problem}: set MOORLINE_FAST_PATHS=false and update {name.user}"
    )


def problems(library: str | None = None) -> list[str]:
    """One message per private name (of ``library``, default all) that does not fit."""
    found: list[str] = []
    for name in PRIVATE_NAMES:
        if library is not None and name.library != library:
            continue
        problem = mismatch(name)
        if problem is not None:
            found.append(describe(name, problem))
    return found


@functools.cache
def _checked(library: str) -> tuple[str, ...]:
    # Cached: the installed code does not change while the process runs.
    return tuple(problems(library))


def require(library: str) -> None:
    """Check, once per process, that ``library`` still has the private names listed for it.

    A fast path calls this before its first use.

    Raises:
        ConfigError: a name is gone or changed shape; the message is one line naming the
            library, the name and ``MOORLINE_FAST_PATHS``.
    """
    found = _checked(library)
    if found:
        raise ConfigError(found[0])


LIBRARIES: Sequence[str] = tuple(sorted({name.library for name in PRIVATE_NAMES}))
"""The libraries whose internals a fast path uses (each bounded in ``pyproject.toml``)."""
