"""The workflow registry: names, limits and input validation from the signature."""

from typing import Any

import pytest

from moorline.engine.registry import Moorline
from moorline.errors import ConfigError, InvalidInput, WorkflowNotFound


def make_app() -> Moorline:
    app = Moorline()

    @app.workflow("review_pr", max_attempts=5, timeout=600)
    async def review_pr(ctx: Any, pr_number: int, diff: str, draft: bool = False) -> dict[str, Any]:
        return {"pr": pr_number}

    return app


def test_registration_keeps_name_and_limits() -> None:
    app = make_app()
    definition = app.get("review_pr")
    assert (definition.name, definition.max_attempts, definition.timeout_s) == ("review_pr", 5, 600)
    assert definition.parameters == ("pr_number", "diff", "draft")
    assert "review_pr" in app
    assert [d.name for d in app] == ["review_pr"]


def test_two_apps_do_not_share_workflows() -> None:
    make_app()
    assert "review_pr" not in Moorline()


def test_valid_input_is_converted_to_json() -> None:
    definition = make_app().get("review_pr")
    assert definition.validate_input({"pr_number": "7", "diff": "x"}) == {
        "pr_number": 7,
        "diff": "x",
        "draft": False,
    }
    assert definition.bind({"pr_number": 7, "diff": "x"}) == {
        "pr_number": 7,
        "diff": "x",
        "draft": False,
    }


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"diff": "x"}, "pr_number"),
        ({"pr_number": "seven", "diff": "x"}, "pr_number"),
        ({"pr_number": 1, "diff": "x", "extra": 1}, "extra"),
    ],
)
def test_invalid_input_names_the_field(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        make_app().get("review_pr").validate_input(data)


def test_unknown_workflow() -> None:
    with pytest.raises(WorkflowNotFound):
        Moorline().get("nope")


def test_bad_registrations_fail_at_import_time() -> None:
    app = Moorline()
    with pytest.raises(ConfigError, match="async def"):

        @app.workflow("sync")  # type: ignore[type-var]
        def not_async(ctx: Any) -> None:
            return None

    with pytest.raises(ConfigError, match="name"):
        app.workflow("has space")
    with pytest.raises(ConfigError, match="max_attempts"):
        app.workflow("w", max_attempts=0)

    @app.workflow("dup")
    async def first(ctx: Any) -> None:
        return None

    with pytest.raises(ConfigError, match="twice"):

        @app.workflow("dup")
        async def second(ctx: Any) -> None:
            return None


def test_time_limits_are_kept_and_checked() -> None:
    app = Moorline()

    @app.workflow("limited", timeout=60, soft_timeout=45)
    async def limited(ctx: Any) -> None:
        return None

    definition = app.get("limited")
    assert (definition.timeout_s, definition.soft_timeout_s) == (60, 45)
    assert make_app().get("review_pr").soft_timeout_s is None
    with pytest.raises(ConfigError, match="soft_timeout must be below timeout"):
        app.workflow("w", timeout=10, soft_timeout=10)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="soft_timeout must be a positive number"):
            app.workflow("w", soft_timeout=bad)
        with pytest.raises(ConfigError, match="timeout must be a positive number"):
            app.workflow("w", timeout=bad)
