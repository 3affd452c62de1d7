"""An outage of the runtime store said once: a warning, debug lines, a line when it is over."""

import logging

import pytest

from moorline.engine.outages import OutageLog

LOGGER = logging.getLogger("tests.outages")


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER.name]


def test_an_outage_is_one_warning_its_other_failures_debug_and_its_end_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    now = [100.0]
    log = OutageLog(LOGGER, "the store", quiet_s=60.0, clock=lambda: now[0])
    log.answered()  # no outage: nothing to say
    for run in ("a", "b", "a"):
        log.failed("run %s: failed", run, extra={})
        now[0] += 1.0
    log.answered()
    log.answered()
    assert said(caplog) == [
        ("WARNING", "run a: failed (more such failures at debug level until it answers)"),
        ("DEBUG", "run b: failed"),
        ("DEBUG", "run a: failed"),
        ("INFO", "the store answers again after failing for 3.0 s"),
    ]


def test_failures_a_quiet_period_apart_are_two_outages(caplog: pytest.LogCaptureFixture) -> None:
    """For a caller that never learns the store answers again (a wait that lasts minutes)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER.name)
    now = [0.0]
    log = OutageLog(LOGGER, "the store", quiet_s=60.0, clock=lambda: now[0])
    for at in (0.0, 59.0, 118.0, 178.5):
        now[0] = at
        log.failed("failed", extra={})
    assert [level for level, _ in said(caplog)] == ["WARNING", "DEBUG", "DEBUG", "WARNING"]
