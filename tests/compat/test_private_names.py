"""Every private name of another library that a fast path touches is still there, as expected.

The list is :data:`moorline.fastpaths.PRIVATE_NAMES`, which the fast paths themselves check
before their first use: an upgrade that renames or reshapes one fails here first, with one line
naming the library, the name and the setting that falls back to the public path.
"""

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from limits.storage import MemoryStorage

from moorline import fastpaths
from moorline.errors import ConfigError
from moorline.fastpaths import PRIVATE_NAMES, PrivateName, Shape

ONE_LINE = re.compile(
    r"^(?P<library>[\w-]+) \S+ (no longer has|has) .+: set MOORLINE_FAST_PATHS=false"
    r" and update moorline/\S+\.py$"
)


@pytest.mark.parametrize("name", PRIVATE_NAMES, ids=lambda n: f"{n.owner}.{n.name}")
def test_a_private_name_is_there_with_its_shape(name: PrivateName) -> None:
    problem = fastpaths.mismatch(name)
    if problem is not None:
        pytest.fail(fastpaths.describe(name, problem), pytrace=False)


def test_every_library_whose_internals_are_used_is_bounded_above() -> None:
    # pyproject.toml names each library with an upper bound (the next release may break it).
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    for library in fastpaths.LIBRARIES:
        bound = re.search(rf'"{library}(\[[\w,]+\])?>=[\d.]+,<[\d.]+"', pyproject)
        assert bound is not None, f"pyproject.toml: {library} has no upper bound"


def test_a_name_gone_fails_with_one_line_naming_library_name_and_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(MemoryStorage, "_MemoryStorage__expire_events")
    found = fastpaths.problems("limits")
    assert len(found) == 1
    message = found[0]
    assert "\n" not in message
    match = ONE_LINE.match(message)
    assert match is not None, message
    assert match["library"] == "limits"
    assert "MemoryStorage._MemoryStorage__expire_events" in message
    assert message.endswith(
        "no longer has MemoryStorage._MemoryStorage__expire_events: set"
        " MOORLINE_FAST_PATHS=false and update moorline/admission/ratelimit.py"
    )


def test_a_fast_path_refuses_to_start_without_its_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # require() is what the fast paths call; its answer is cached per process, so the cache is
    # cleared around the check.
    monkeypatch.delattr(MemoryStorage, "_MemoryStorage__schedule_expiry")
    fastpaths._checked.cache_clear()
    try:
        with pytest.raises(ConfigError) as raised:
            fastpaths.require("limits")
    finally:
        fastpaths._checked.cache_clear()
    assert ONE_LINE.match(str(raised.value)), str(raised.value)
    assert "_MemoryStorage__schedule_expiry" in str(raised.value)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            PrivateName(
                library="aiosqlite",
                owner="aiosqlite.Connection",
                name="_execute",
                shape=Shape.METHOD,
                details=("function",),
                user="moorline/db/sqlite_driver.py",
            ),
            "has Connection._execute(fn, args, kwargs), not (function, ...)",
        ),
        (
            PrivateName(
                library="aiosqlite",
                owner="aiosqlite.Connection",
                name="_gone",
                shape=Shape.ATTRIBUTE,
                user="moorline/db/sqlite_driver.py",
            ),
            "no longer has Connection._gone",
        ),
        (
            PrivateName(
                library="starlette",
                owner="starlette.responses.Response",
                name="__init__",
                shape=Shape.INIT_SETS,
                details=("body", "status_code"),
                user="moorline/api/routes/trigger.py",
            ),
            "has Response.__init__ setting ['background', 'body', 'raw_headers', 'status_code'],"
            " not ['body', 'status_code']",
        ),
        (
            PrivateName(
                library="starlette",
                owner="starlette.routing.Route",
                name="handle",
                shape=Shape.SOURCE,
                details=("self.application(",),
                user="moorline/api/guards.py",
            ),
            "has Route.handle without 'self.application('",
        ),
        (
            PrivateName(
                library="fastapi",
                owner="fastapi.routing.APIRouter",
                name="add_api_route",
                shape=Shape.KEYWORDS,
                details=("route_class",),
                user="moorline/api/routes/trigger.py",
            ),
            "has APIRouter.add_api_route without its route_class argument",
        ),
        (
            PrivateName(
                library="aiomysql",
                owner="aiomysql.NoSuchClass",
                name="_reader",
                shape=Shape.ATTRIBUTE,
                user="moorline/db/mysql_driver.py",
            ),
            "no longer has aiomysql.NoSuchClass",
        ),
    ],
)
def test_each_shape_says_how_a_name_differs(name: PrivateName, expected: str) -> None:
    problem = fastpaths.mismatch(name)
    assert problem == expected
    assert ONE_LINE.match(fastpaths.describe(name, problem))


@pytest.fixture
def fresh_checks() -> Iterator[None]:
    """Forget the checks made so far (require() makes each once per process)."""
    fastpaths._checked.cache_clear()
    yield
    fastpaths._checked.cache_clear()


@pytest.mark.usefixtures("fresh_checks")
async def test_each_fast_path_checks_its_names_and_its_fallback_needs_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiosqlite
    from fastapi import APIRouter, FastAPI

    from moorline.admission.ratelimit import RateLimiter
    from moorline.api.routes import runs as runs_routes
    from moorline.db import mysql_driver, sqlite_driver
    from moorline.settings import Settings

    monkeypatch.delattr(aiosqlite.Connection, "_execute")
    with pytest.raises(ConfigError, match=r"aiosqlite .* Connection\._execute:"):
        sqlite_driver.connector([":memory:"], {})
    assert callable(sqlite_driver.connector([":memory:"], {}, fast=False))

    monkeypatch.delattr(MemoryStorage, "_MemoryStorage__schedule_expiry")
    with pytest.raises(
        ConfigError, match=r"limits .* MemoryStorage\._MemoryStorage__schedule_expiry:"
    ):
        RateLimiter(Settings())
    await RateLimiter(Settings(fast_paths=False)).close()

    monkeypatch.setattr(APIRouter, "add_api_route", lambda self, path: None)
    app = FastAPI()
    app.state.settings = Settings()
    with pytest.raises(
        ConfigError, match=r"fastapi .* APIRouter\.add_api_route without its route_class_override"
    ):
        runs_routes.install(app)

    import aiomysql

    monkeypatch.delattr(aiomysql.Connection, "_connect")
    with pytest.raises(ConfigError, match=r"aiomysql .* Connection\._connect:"):
        await mysql_driver.connect(host="127.0.0.1", port=1)


def test_a_library_that_breaks_the_check_itself_still_gets_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from starlette.responses import Response

    def changed(self: object, *args: object, **kwargs: object) -> None:
        raise TypeError("__init__() missing 1 required keyword-only argument: 'status'")

    monkeypatch.setattr(Response, "__init__", changed)
    found = fastpaths.problems("starlette")
    assert len(found) == 1
    assert ONE_LINE.match(found[0]), found[0]
    assert "Response that cannot be checked (TypeError: __init__() missing" in found[0]
