"""Persisted and API-visible names are contract: statuses are pinned here."""

from moorline.types import TERMINAL_STATUSES, RunStatus


def test_run_statuses_match_api_md() -> None:
    assert [s.value for s in RunStatus] == [
        "pending",
        "queued",
        "running",
        "waiting",
        "succeeded",
        "failed",
        "cancelled",
        "timed_out",
        "rate_limited",
    ]


def test_terminal_statuses() -> None:
    assert {s.value for s in TERMINAL_STATUSES} == {
        "succeeded",
        "failed",
        "cancelled",
        "timed_out",
        "rate_limited",
    }
    assert all(s.is_terminal for s in TERMINAL_STATUSES)
    assert not RunStatus.RUNNING.is_terminal
    assert not RunStatus.WAITING.is_terminal
