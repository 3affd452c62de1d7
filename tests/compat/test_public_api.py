"""Pins the public Python surface: a change to ``moorline.__all__`` must be deliberate."""

import moorline

EXPECTED = {
    "BackendUnavailable",
    "BudgetExceeded",
    "Cancelled",
    "ChildFailed",
    "Client",
    "ConfigError",
    "Conflict",
    "Context",
    "Decision",
    "LimitExceeded",
    "Moorline",
    "MoorlineError",
    "NotFound",
    "RunParked",
    "RunStatus",
    "Settings",
    "SoftTimeLimitExceeded",
    "Submission",
    "Submitted",
    "SyncClient",
    "__version__",
}


def test_public_names_are_pinned() -> None:
    assert set(moorline.__all__) == EXPECTED


def test_every_public_name_exists() -> None:
    for name in moorline.__all__:
        assert hasattr(moorline, name), name
