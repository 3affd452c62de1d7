"""The peer run's tables: every system's figures, and Moorline ÷ each peer on the same storage."""

GROUPS: list[tuple[str, list[str]]] = [
    ("SQLite", ["moorline-sqlite", "huey-sqlite"]),
    ("PostgreSQL", ["moorline-pg", "pgqueuer-pg", "procrastinate-pg", "dbos-pg"]),
    ("Redis", ["moorline-pgredis", "celery-redis", "celery-acks-late-redis", "huey-redis"]),
]
"""Storage → its systems, Moorline first: ratios are taken within a group only."""

_MOORLINE_COMMON = (
    "a submission returns once its run is committed; a claim takes a lease and the outcome is "
    "committed after the run; a killed worker's run runs again after its lease (never lost)"
)
DURABILITY = {
    "moorline-sqlite": f"SQLite file, WAL, synchronous=NORMAL (an OS crash may lose the last "
    f"commits, a process crash none); {_MOORLINE_COMMON}",
    "moorline-pg": f"PostgreSQL, synchronous_commit on; {_MOORLINE_COMMON}",
    "moorline-pgredis": f"PostgreSQL, synchronous_commit on, Redis for admission counters and "
    f"wake-ups only (nothing durable in it); {_MOORLINE_COMMON}",
    "huey-sqlite": "SQLite file, WAL, SQLite's default synchronous (FULL); the consumer takes a "
    "task off the queue before running it: a killed consumer loses it; result stored after",
    "pgqueuer-pg": "PostgreSQL (durable: logged tables), an enqueue returns once committed; a "
    "job is 'picked' while it runs, re-picked after its heartbeat times out; done when it "
    "leaves the queue",
    "procrastinate-pg": "PostgreSQL, a defer returns once committed; the job is 'doing' while "
    "it runs, its outcome committed after (a killed worker's job stays 'doing' until retried)",
    "dbos-pg": "PostgreSQL, an enqueue returns once committed; the outcome of the workflow and "
    "of each step is committed; a killed worker's workflows are recovered",
    "celery-redis": "Redis broker without persistence configured (a Redis restart loses the "
    "queue); acks a task when a worker takes it, BEFORE running it (acks_late off, the "
    "default): a killed worker loses its tasks; no result stored",
    "celery-acks-late-redis": "as celery-redis, but acks after running (acks_late on): a "
    "killed worker's tasks are delivered again after the visibility timeout",
    "huey-redis": "Redis without persistence configured; the consumer takes a task off the "
    "queue before running it; result stored after",
}

_COLUMNS = [
    ("enqueue", "enqueue, 1 at a time (Moorline: `app.submit`)"),
    ("enqueue_http", "Moorline `Client.trigger`, 1 at a time"),
    ("bulk", "bulk (Moorline: `submit_many`)"),
    ("bulk_http", "Moorline `Client.trigger_many`"),
    ("drain", "drain, 1 worker at defaults"),
    ("drain_wide", "Moorline drain, wider worker"),
    ("drain_step", "drain, 1 checkpointed step"),
    ("latency_p50", "enqueue → start p50, ms"),
    ("latency_p99", "p99, ms"),
]


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def figures_table(median: dict[str, dict[str, float]]) -> list[str]:
    """One row per system measured: tasks/s, and latency in ms."""
    lines = [
        "| system | " + " | ".join(title for _, title in _COLUMNS) + " |",
        "|---|" + "---:|" * len(_COLUMNS),
    ]
    for _, members in GROUPS:
        for system in members:
            if system not in median:
                continue
            it = median[system]
            cells = [
                _cell(it.get(key), 1 if key.startswith("latency") else 0) for key, _ in _COLUMNS
            ]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return lines


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or theirs == 0:
        return "-"
    return f"{ours / theirs:.2f}x"


def ratio_table(median: dict[str, dict[str, float]]) -> list[str]:
    """Moorline ÷ each peer of its storage, per workload (latency: below 1 is Moorline faster)."""
    heads = [
        "`app.submit` ÷ its enqueue",
        "`Client.trigger` ÷ its enqueue",
        "`submit_many` ÷ its bulk",
        "`trigger_many` ÷ its bulk",
        "drain at defaults ÷ its drain",
        "wider worker ÷ its drain",
        "step drain ÷ its",
        "latency p50, Moorline ÷ it",
        "p99",
    ]
    lines = ["| storage | peer | " + " | ".join(heads) + " |", "|---|---|" + "---:|" * len(heads)]
    for storage, members in GROUPS:
        ours = median.get(members[0])
        if ours is None:
            continue
        for peer in members[1:]:
            it = median.get(peer)
            if it is None:
                continue
            cells = [
                _ratio(ours.get("enqueue"), it.get("enqueue")),
                _ratio(ours.get("enqueue_http"), it.get("enqueue")),
                _ratio(ours.get("bulk"), it.get("bulk")),
                _ratio(ours.get("bulk_http"), it.get("bulk")),
                _ratio(ours.get("drain"), it.get("drain")),
                _ratio(ours.get("drain_wide"), it.get("drain")),
                _ratio(ours.get("drain_step"), it.get("drain_step")),
                _ratio(ours.get("latency_p50"), it.get("latency_p50")),
                _ratio(ours.get("latency_p99"), it.get("latency_p99")),
            ]
            lines.append(f"| {storage} | {peer} | " + " | ".join(cells) + " |")
    return lines
