"""Prometheus metrics: what ``GET /metrics`` serves, and the counters the code paths bump.

Two kinds of figure, kept apart on purpose:

- **State, read at scrape time** (:class:`Snapshot`): runs by status and lane, queue depth and
  the oldest queued run's age per lane, the queued runs no live worker serves (by lane and
  workflow: ``moorline_runs_unserved``), pending interrupts, event-stream subscribers, the
  database pool and the SQLite WAL file. The database is the one place every process writes
  to, so a figure read from it at scrape time is right however many ``moorline serve`` and
  ``moorline worker`` processes, on however many hosts, share the database, and stays right
  across their restarts. The queries walk ``ix_runs_lane_tenant`` (``status, lane, …``): a
  count per (status, lane) is an index-only scan, and the oldest eligible queued run of a lane
  is the first entry of its range. Terminal statuses only ever grow, so they are served as the
  counter ``moorline_runs_total``: the runs in the table plus those the retention cleaner
  deleted (kept in ``retention_tallies``, which also serves
  ``moorline_retention_deleted_total``), so deletion never makes it fall; the statuses a run
  leaves (``pending``, ``queued``, ``running``, ``waiting``) as the gauge
  ``moorline_runs_active``. LLM usage (``moorline_llm_tokens_total``,
  ``moorline_llm_cost_total``, ``moorline_llm_requests_total``) is read the same way, from
  ``llm_usage``, which the workers add to with each step checkpoint: one figure however many
  workers made the calls. Labels are the model (and the kind or outcome); a ``tenant`` label
  only with ``MOORLINE_METRICS_TENANT_LABEL`` (a series per tenant and model).
- **Events, counted where they happen** (:class:`Metrics`): attempt durations and dispatch
  latency (histograms), retries, reclaims, lease losses, quota and rate-limit rejections.
  Reading these back from the database would mean scanning history at every scrape. They live
  in the process that saw the event. ``moorline serve --workers N`` runs its N worker loops,
  its reaper and its admission in one process, so its ``/metrics`` sees all of its own events
  without any cross-process machinery (which is why ``serve`` needs no private
  ``PROMETHEUS_MULTIPROC_DIR``). Separate ``moorline worker`` processes on the same host join
  in through prometheus-client's multiprocess mode: when the operator sets
  ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory, emptied again between deployments, as
  prometheus-client requires) for the server and the workers alike, every process writes its
  events there and :func:`render` sums them. No event metric is a gauge, so no
  ``mark_process_dead`` bookkeeping is needed when a worker exits. Workers on other hosts
  show in the database figures only.

A scrape's database reads are index scans (:mod:`moorline.db.repos.gauges`);
``bench/metrics_scrape.py`` times one over 100,000 stored runs (figures in docs/performance.md).

Metric objects are built per :class:`Metrics` instance with ``registry=None``: nothing is
registered in prometheus-client's global registry, and each app or worker process (or test)
gets its own, passed down like the settings.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from moorline.types import TERMINAL_STATUSES, RunStatus

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)
"""From a no-op workflow (milliseconds) to an agent run near the default 30-minute limit."""

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""From a wake-up claim (milliseconds) to a backlog of a minute."""


class Metrics:
    """The event metrics of one process (see the module docstring for what else is served)."""

    def __init__(self) -> None:
        self.run_duration_s = Histogram(
            "moorline_run_duration_seconds",
            "Seconds from claim to written outcome of the attempts this process ran, by lane, "
            "workflow and outcome (succeeded, failed, retried, cancelled, timed_out).",
            ["lane", "workflow", "outcome"],
            buckets=DURATION_BUCKETS_S,
            registry=None,
        )
        self.dispatch_latency_s = Histogram(
            "moorline_dispatch_latency_seconds",
            "Seconds a run waited between becoming claimable and being claimed, by lane.",
            ["lane"],
            buckets=LATENCY_BUCKETS_S,
            registry=None,
        )
        self.retries = Counter(
            "moorline_retries",
            "Failed attempts given another attempt (with backoff), by lane and workflow.",
            ["lane", "workflow"],
            registry=None,
        )
        self.reclaims = Counter(
            "moorline_reclaims",
            "Runs the reaper took back from an expired lease, by lane and where they went "
            "(queued again, failed after their last attempt, cancelled).",
            ["lane", "status"],
            registry=None,
        )
        self.lease_losses = Counter(
            "moorline_lease_losses",
            "Attempts stopped because their lease was lost (reclaimed, self-fenced, "
            "cancelled under them), by lane.",
            ["lane"],
            registry=None,
        )
        self.parks = Counter(
            "moorline_parks",
            "Attempts that parked their run (waiting, no slot held), by lane and by what the "
            "run waits for (permission, sleep, message).",
            ["lane", "kind"],
            registry=None,
        )
        self.resumes = Counter(
            "moorline_timer_resumes",
            "Waiting runs the timer sweep moved, by lane and where they went (queued when "
            "their timer was due, timed_out past their deadline).",
            ["lane", "status"],
            registry=None,
        )
        self.rejections = Counter(
            "moorline_rejections",
            "Triggers refused by admission, by reason (quota_exceeded, rate_limited, "
            "budget_exhausted).",
            ["reason"],
            registry=None,
        )
        self.schedule_ticks = Counter(
            "moorline_schedule_ticks",
            "Schedule ticks the scheduler submitted, by outcome (fired: the run is stored; "
            "refused: admission refused it).",
            ["outcome"],
            registry=None,
        )

    def collectors(self) -> list[Collector]:
        """The metric objects, to register in a scrape's registry."""
        return [
            self.run_duration_s,
            self.dispatch_latency_s,
            self.retries,
            self.reclaims,
            self.lease_losses,
            self.parks,
            self.resumes,
            self.rejections,
            self.schedule_ticks,
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneFigures:
    """One lane's queue at scrape time."""

    queued: int
    oldest_queued_age_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LLMFigures:
    """The all-time LLM usage of one model (of one tenant, with the tenant label)."""

    model: str
    tenant: str | None = None
    """None: every tenant's together (no ``tenant`` label)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    saved_tokens: int = 0
    requests: int = 0
    failed_requests: int = 0
    cost: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """The state figures of one scrape, read from the database and this process."""

    runs: Mapping[tuple[str, str], int]
    """(lane, status) → runs in that status."""
    lanes: Mapping[str, LaneFigures]
    interrupts_pending: int
    sse_subscribers: int
    unserved: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(lane, workflow) → queued runs no live worker serves; only pairs that have some."""
    pool_checked_out: int
    pool_size: int
    sqlite_wal_bytes: int | None = None
    """None when the database is not a SQLite file."""
    runs_deleted: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(lane, status) → ended runs the retention cleaner deleted (added to ``runs``)."""
    rows_deleted: Mapping[str, int] = field(default_factory=dict)
    """Table name → rows the retention cleaner deleted."""
    oldest_finished_age_s: float | None = None
    """Seconds since the oldest stored finished run ended; None when there is none."""
    llm: tuple[LLMFigures, ...] = ()
    """LLM usage per model (and tenant), from the database."""


class _SnapshotCollector(Collector):
    """Serves a :class:`Snapshot` as metric families (read before, since collect is sync)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot
        ended = CounterMetricFamily(
            "moorline_runs",
            "Runs that ended, by lane and final status (from the database: every process's).",
            labels=["lane", "status"],
        )
        active = GaugeMetricFamily(
            "moorline_runs_active",
            "Runs that have not ended, by lane and status (from the database).",
            labels=["lane", "status"],
        )
        lanes = sorted({lane for lane, _ in (*s.runs, *s.runs_deleted)} | set(s.lanes))
        for lane in lanes:
            for status in RunStatus:
                count = s.runs.get((lane, status.value), 0)
                if status in TERMINAL_STATUSES:
                    gone = s.runs_deleted.get((lane, status.value), 0)
                    ended.add_metric([lane, status.value], count + gone)
                else:
                    active.add_metric([lane, status.value], count)
        yield ended
        yield active
        depth = GaugeMetricFamily(
            "moorline_queue_depth", "Queued runs per lane (from the database).", labels=["lane"]
        )
        oldest = GaugeMetricFamily(
            "moorline_queue_oldest_age_seconds",
            "How long the oldest claimable queued run of each lane has waited (0: none).",
            labels=["lane"],
        )
        for lane, figures in sorted(s.lanes.items()):
            depth.add_metric([lane], figures.queued)
            oldest.add_metric([lane], figures.oldest_queued_age_s or 0.0)
        yield depth
        yield oldest
        unserved = GaugeMetricFamily(
            "moorline_runs_unserved",
            "Queued runs whose workflow no live worker serves in their lane, by lane and "
            "workflow (from the database; a pair with none is absent).",
            labels=["lane", "workflow"],
        )
        for (lane, workflow), count in sorted(s.unserved.items()):
            unserved.add_metric([lane, workflow], count)
        yield unserved
        deleted = CounterMetricFamily(
            "moorline_retention_deleted",
            "Rows the retention cleaner deleted, by table (runs, steps, events, interrupts, "
            "messages; from the database: every process's).",
            labels=["table"],
        )
        for table, count in sorted(s.rows_deleted.items()):
            deleted.add_metric([table], count)
        yield deleted
        yield from _llm_families(s.llm)
        yield _gauge(
            "moorline_oldest_finished_run_age_seconds",
            "Seconds since the oldest finished run still stored ended (0: none); retention "
            "keeps it near the longest retention in force.",
            s.oldest_finished_age_s or 0.0,
        )
        yield _gauge(
            "moorline_interrupts_pending",
            "Interrupts waiting for a decision (from the database).",
            s.interrupts_pending,
        )
        yield _gauge(
            "moorline_sse_subscribers",
            "Event streams open on this API process.",
            s.sse_subscribers,
        )
        yield _gauge(
            "moorline_db_pool_checked_out",
            "Database connections of this process in use now.",
            s.pool_checked_out,
        )
        yield _gauge(
            "moorline_db_pool_size", "Database connections this process keeps.", s.pool_size
        )
        if s.sqlite_wal_bytes is not None:
            yield _gauge(
                "moorline_sqlite_wal_bytes",
                "Size of the SQLite write-ahead log file, in bytes.",
                s.sqlite_wal_bytes,
            )


def _llm_families(figures: tuple[LLMFigures, ...]) -> Iterator[Metric]:
    """The three LLM counters; with a ``tenant`` label when the figures carry tenants."""
    extra = ["tenant"] if any(f.tenant is not None for f in figures) else []
    tokens = CounterMetricFamily(
        "moorline_llm_tokens",
        "LLM tokens by model and kind: prompt (cached included), completion, cached, and "
        "saved (not spent again by replayed steps); from the database, every worker's.",
        labels=["model", "kind", *extra],
    )
    cost = CounterMetricFamily(
        "moorline_llm_cost",
        "What LLM calls cost, priced by the models file when they were made, by model.",
        labels=["model", *extra],
    )
    requests = CounterMetricFamily(
        "moorline_llm_requests",
        "LLM calls by model and outcome (ok, error: failed or left before the reply ended).",
        labels=["model", "outcome", *extra],
    )
    for f in sorted(figures, key=lambda f: (f.model, f.tenant or "")):
        tenant = [f.tenant or ""] if extra else []
        for kind, value in (
            ("prompt", f.prompt_tokens),
            ("completion", f.completion_tokens),
            ("cached", f.cached_tokens),
            ("saved", f.saved_tokens),
        ):
            tokens.add_metric([f.model, kind, *tenant], value)
        cost.add_metric([f.model, *tenant], f.cost)
        requests.add_metric([f.model, "ok", *tenant], f.requests - f.failed_requests)
        requests.add_metric([f.model, "error", *tenant], f.failed_requests)
    yield tokens
    yield cost
    yield requests


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def is_multiprocess() -> bool:
    """Whether prometheus-client chose multiprocess mode when it was imported.

    It reads ``PROMETHEUS_MULTIPROC_DIR`` once, at import; asking it what it chose (rather than
    reading the variable again) keeps the scrape in step with where the values really are.
    """
    return values.ValueClass is not values.MutexValue


def render(metrics: Metrics, snapshot: Snapshot) -> bytes:
    """The Prometheus text exposition of one scrape.

    In multiprocess mode the event metrics come from the shared directory (this process's and
    every other's); otherwise from ``metrics``, this process's own.
    """
    registry = CollectorRegistry(auto_describe=False)
    if is_multiprocess():
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        for collector in metrics.collectors():
            registry.register(collector)
    registry.register(_SnapshotCollector(snapshot))
    return generate_latest(registry)
