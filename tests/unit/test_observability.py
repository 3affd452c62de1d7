"""Log formats, run context and redaction; the metrics exposition of a snapshot. No I/O."""

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moorline.api.redaction import redact
from moorline.errors import ConfigError
from moorline.observability.logs import bind_run, make_handler
from moorline.observability.metrics import LaneFigures, Metrics, Snapshot, render
from moorline.settings import LogFormat, Settings, load_settings

ADMIN_TOKEN = "admin-token-0123456789"
KEY = "ml_" + "Ab9_-" * 8 + "xyz"


@pytest.fixture
def logged(request: pytest.FixtureRequest) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing through one of our handlers into a buffer (format: the param)."""
    buffer = io.StringIO()
    log_format: LogFormat = getattr(request, "param", LogFormat.TEXT)
    settings = Settings(log_format=log_format, admin_token=ADMIN_TOKEN)
    handler = make_handler(settings, stream=buffer, scrub=redact)
    logger = logging.getLogger(f"tests.observability.{request.node.name}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger, buffer
    finally:
        logger.removeHandler(handler)


def test_text_lines_name_the_bound_run_and_only_inside_it(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = logged
    with bind_run("run-1", 2, "tenant-1"):
        logger.info("inside")
    logger.info("outside")
    inside, outside = buffer.getvalue().splitlines()
    assert inside.endswith("inside run_id=run-1 attempt=2 tenant_id=tenant-1")
    assert outside.endswith("outside")


async def test_tasks_started_in_an_attempt_inherit_its_run(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = logged

    async def child() -> None:
        logger.info("from a child task")

    with bind_run("run-2", 1, "tenant-2"):
        task = asyncio.create_task(child())
    await task
    assert "run_id=run-2 attempt=1 tenant_id=tenant-2" in buffer.getvalue()


def test_an_explicit_extra_wins_over_the_bound_run(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = logged
    with bind_run("run-1", 1, "tenant-1"):
        logger.info("other", extra={"run_id": "run-9", "attempt": 3, "tenant_id": "t-9"})
    assert "run_id=run-9 attempt=3 tenant_id=t-9" in buffer.getvalue()


@pytest.mark.parametrize("logged", [LogFormat.JSON], indirect=True)
def test_json_is_one_object_per_line_with_run_fields_extras_and_traceback(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = logged
    with bind_run("run-3", 1, "tenant-3"):
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            logger.exception("it failed for %s", "reasons", extra={"lane": "workflow_team"})
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["message"] == "it failed for reasons"
    assert (entry["level"], entry["lane"]) == ("ERROR", "workflow_team")
    assert (entry["run_id"], entry["attempt"], entry["tenant_id"]) == ("run-3", 1, "tenant-3")
    assert "ValueError: boom" in entry["exception"]


@pytest.mark.parametrize("logged", [LogFormat.TEXT, LogFormat.JSON], indirect=True)
def test_no_secret_survives_in_message_arguments_extras_or_tracebacks(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = logged
    logger.info("admin token %s", ADMIN_TOKEN)
    logger.info("headers %s", {"Authorization": "Bearer sk-upstream-credential"})
    logger.info("GET /v1/runs?api_key=%s", KEY)
    logger.info('config {"webhook_secret": "whsec-abcdef", "password": "hunter22"}')
    logger.info("delivery", extra={"detail": f"key {KEY}"})
    try:
        raise RuntimeError(f"rejected token={ADMIN_TOKEN}")
    except RuntimeError:
        logger.exception("failed")
    output = buffer.getvalue()
    for secret in (ADMIN_TOKEN, "sk-upstream-credential", KEY, "whsec-abcdef", "hunter22"):
        assert secret not in output
    assert "Bearer [redacted]" in output
    if "{" in output.splitlines()[0][:1]:  # JSON: redaction kept every line parseable
        for line in output.splitlines():
            json.loads(line)


def test_the_log_format_is_validated_with_one_line() -> None:
    assert Settings(log_format=LogFormat.JSON).log_format is LogFormat.JSON
    with pytest.raises(ConfigError, match="MOORLINE_LOG_FORMAT"):
        load_settings(log_format="xml")


def test_a_snapshot_is_served_as_counters_and_gauges() -> None:
    metrics = Metrics()
    metrics.retries.labels(lane="workflow_team", workflow="echo").inc(3)
    metrics.rejections.labels(reason="quota_exceeded").inc()
    metrics.run_duration_s.labels(
        lane="workflow_team", workflow="echo", outcome="succeeded"
    ).observe(0.2)
    snapshot = Snapshot(
        runs={("workflow_team", "succeeded"): 7, ("workflow_team", "queued"): 2},
        lanes={"workflow_team": LaneFigures(queued=2, oldest_queued_age_s=1.5)},
        interrupts_pending=1,
        sse_subscribers=4,
        pool_checked_out=1,
        pool_size=5,
        sqlite_wal_bytes=None,
    )
    text = render(metrics, snapshot).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    team = ("lane", "workflow_team")
    assert families["moorline_runs"].type == "counter"
    assert samples[("moorline_runs_total", (team, ("status", "succeeded")))] == 7
    assert samples[("moorline_runs_total", (team, ("status", "failed")))] == 0
    assert samples[("moorline_runs_active", (team, ("status", "queued")))] == 2
    assert ("moorline_runs_total", (team, ("status", "queued"))) not in samples
    assert samples[("moorline_queue_depth", (team,))] == 2
    assert samples[("moorline_queue_oldest_age_seconds", (team,))] == 1.5
    echo = ("workflow", "echo")
    assert samples[("moorline_retries_total", (team, echo))] == 3
    assert samples[("moorline_rejections_total", (("reason", "quota_exceeded"),))] == 1
    count = ("moorline_run_duration_seconds_count", (team, ("outcome", "succeeded"), echo))
    assert samples[count] == 1
    assert samples[("moorline_sse_subscribers", ())] == 4
    assert samples[("moorline_interrupts_pending", ())] == 1
    assert (
        samples[("moorline_db_pool_checked_out", ())],
        samples[("moorline_db_pool_size", ())],
    ) == (1, 5)
    assert "moorline_sqlite_wal_bytes" not in families  # not a SQLite file
    # Each Metrics is its own: nothing leaks into a second one (no global registry).
    again = render(Metrics(), snapshot).decode()
    assert "moorline_retries_total{" not in again


def test_deleted_runs_stay_counted_and_retention_is_served() -> None:
    snapshot = Snapshot(
        runs={("workflow_team", "succeeded"): 7},
        lanes={},
        interrupts_pending=0,
        sse_subscribers=0,
        pool_checked_out=0,
        pool_size=5,
        runs_deleted={("workflow_team", "succeeded"): 100, ("gone_lane", "failed"): 3},
        rows_deleted={"runs": 103, "events": 400},
        oldest_finished_age_s=86400.0,
    )
    text = render(Metrics(), snapshot).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    team = ("lane", "workflow_team")
    assert samples[("moorline_runs_total", (team, ("status", "succeeded")))] == 107
    # A lane whose runs were all deleted is still served, its count never falling to 0.
    assert samples[("moorline_runs_total", (("lane", "gone_lane"), ("status", "failed")))] == 3
    assert samples[("moorline_retention_deleted_total", (("table", "runs"),))] == 103
    assert samples[("moorline_retention_deleted_total", (("table", "events"),))] == 400
    assert samples[("moorline_oldest_finished_run_age_seconds", ())] == 86400.0
