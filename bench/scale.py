"""The scaling curve (issue 22, item 4): drain rate against the number of worker processes.

For each backend, kind of run and number of workers: ``--runs`` runs are enqueued through the
public fast path (``app.submit_many``, the admission of the HTTP batch), spread over
32 tenants; then that many ``moorline worker`` processes (the public CLI, default settings:
14 slots on the community edition's one lane, its default poll and lease) drain them. Kinds:

- ``noop``: the workflow returns at once: the figure is Moorline's own cost per run;
- ``io``: the workflow awaits ``asyncio.sleep(0.05)``, a stand-in for a model call: a worker's
  14 slots cap it at 280 runs/s, so the curve shows whether more processes add that much.

The backends: PostgreSQL + Redis and MariaDB + Redis (1, 2, 4, 8 workers) and SQLite, one file
and no Redis (1, 2, 4). Each backend gets a fresh database, and a redis-server of the bench's
own (no persistence, a free port), so that its CPU is this bench's alone.

The runs are submitted delayed by a day; once every worker has logged that it serves its lane,
one UPDATE makes them all due, so no worker's start-up (imports, connecting) falls inside the
measurement. As ``bench/peers`` times a drain, the clock then runs from 10 % of the runs done
to the last one (the workers' wake-up and first runs outside it). Over that window:

- ``runs/s``: runs finished (no longer ``queued`` or ``running``), polled every 50 ms, and
  every one checked ``succeeded`` at the end;
- ``commits/s``, ``commits/run``: PostgreSQL's ``pg_stat_database.xact_commit`` of the bench's
  database (a backend publishes its counts at most once a second: ±1 s of commits); MariaDB's
  ``Com_commit`` (server-wide: other clients of the server count too); SQLite: n/a;
- CPU per run in ms: the worker processes' user + system time (``/proc``); the database's: the
  PostgreSQL backends, or the MariaDB connection threads, serving the bench's database (their
  background writers and flushers are not counted; SQLite works inside the workers); Redis's
  server process; ``host %``: the busy share of every CPU of the machine.

    PYTHONPATH=. .venv/bin/python bench/scale.py [--backends postgresql,mysql,sqlite]
        [--workers 1,2,4,8] [--runs 4000] [--kind noop,io] [--quick] [--json PATH]
"""

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import analyze, on_fresh_database, seed_tenant
from redis.asyncio import Redis
from redis.exceptions import RedisError
from scale_counters import PROBES, Probe, Sample, cpu_s, host_jiffies
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline import Context, Moorline, Settings, Submission
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.schema import runs
from moorline.db.types import utcnow
from moorline.settings import Edition
from moorline.types import TenantId

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
IO_S = 0.05
TENANTS = 32
"""Tenants the runs are spread over: their caps (8 each) never bind 8 workers' 112 slots."""
PLAN = "professional"
PLANS_YAML = """plans:
  professional:
    lane: workflow
    priority: 100
    daily_quota: 100000000
    rate_limit: "1000000/second"
    tenant_concurrency: 8
    lane_slots: 8
"""
"""The default professional plan with its quota and rate limit lifted, so that admission never
refuses the bench: its cap and slots, with team's 4 and sandbox's 2, give the default 14 slots."""
BATCH = 500
HELD_S = 86400.0
WARM_UP_SHARE = 0.1
POLL_S = 0.05
DEADLINE_S = 900.0
STARTUP_S = 120.0
"""Eight workers importing at once on two loaded CPUs take a while."""
SQLITE_WORKERS = 4
"""SQLite's one file takes one writer at a time: 8 processes only wait for each other longer."""


def build_app(settings: Settings | None = None) -> Moorline:
    """The bench's two workflows; workers load ``app`` below, the bench builds one per database."""
    built = Moorline(settings)

    @built.workflow("noop")
    async def noop(ctx: Context) -> None:
        """Does nothing: the figure is Moorline's cost per run."""

    @built.workflow("io")
    async def io(ctx: Context) -> None:
        """Waits as a model call does, holding its slot and nothing else."""
        await asyncio.sleep(IO_S)

    return built


app = build_app()


@dataclass(frozen=True)
class Row:
    """One measured drain: a line of the table (and of ``--json``)."""

    backend: str
    kind: str
    workers: int
    runs: int
    window_s: float
    runs_per_s: float
    commits_per_s: float | None
    commits_per_run: float | None
    worker_cpu_ms: float
    db_cpu_ms: float | None
    redis_cpu_ms: float | None
    host_busy: float


def row_of(config: tuple[str, str, int], start: Sample, end: Sample) -> Row:
    counted, window = end.done - start.done, end.at - start.at
    commits = None if end.commits is None or start.commits is None else end.commits - start.commits
    server = sum(cpu - start.server_cpu.get(path, 0.0) for path, cpu in end.server_cpu.items())
    busy, total = (e - s for e, s in zip(end.host, start.host, strict=True))
    backend, kind, workers = config
    return Row(
        backend=backend,
        kind=kind,
        workers=workers,
        runs=counted,
        window_s=window,
        runs_per_s=counted / window,
        commits_per_s=None if commits is None else commits / window,
        commits_per_run=None if commits is None else commits / counted,
        worker_cpu_ms=(end.workers_cpu - start.workers_cpu) * 1000 / counted,
        db_cpu_ms=None if backend == "sqlite" else server * 1000 / counted,
        redis_cpu_ms=None
        if backend == "sqlite"
        else (end.redis_cpu - start.redis_cpu) * 1000 / counted,
        host_busy=busy / total if total else 0.0,
    )


# --- the parts: a private Redis, workers --------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the workers of one backend point."""

    backend: str
    url: str
    redis: "PrivateRedis | None"
    folder: Path

    def environment(self) -> dict[str, str]:
        """A worker's environment: this shell's, minus any ``MOORLINE_*``, plus the bench's."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
        env |= {
            "PYTHONPATH": str(REPO_ROOT),
            "MOORLINE_DATABASE_URL": self.url,
            "MOORLINE_EDITION": "community",
            "MOORLINE_PLANS_FILE": str(self.folder / "plans.yaml"),
            "MOORLINE_APP": "scale:app",
        }
        if self.redis is not None:
            env |= {"MOORLINE_REDIS_URL": self.redis.url, "MOORLINE_REDIS_PREFIX": "scale"}
        return env

    def log(self, tag: str, index: int) -> Path:
        return self.folder / f"worker-{self.backend}-{tag}-{index}.log"

    async def ready(self, processes: list[asyncio.subprocess.Process], tag: str) -> None:
        """Until every worker has logged that it serves its lane (or one has ended)."""
        deadline = time.monotonic() + STARTUP_S
        waiting = dict(enumerate(processes))
        while waiting:
            for index, process in list(waiting.items()):
                text = self.log(tag, index).read_text(errors="replace")
                if " serving " in text:
                    del waiting[index]
                elif process.returncode is not None or time.monotonic() > deadline:
                    raise SystemExit(f"bench/scale.py: a worker did not start:\n{text[-3000:]}")
            await asyncio.sleep(0.05)

    def settings(self) -> Settings:
        """The same settings, for the bench's own submissions."""
        return Settings(
            database_url=self.url,
            edition=Edition.COMMUNITY,
            plans_file=self.folder / "plans.yaml",
            redis_url=None if self.redis is None else self.redis.url,
            redis_prefix="scale",
        )


class PrivateRedis:
    """A ``redis-server`` of the bench's own on a free port, keeping nothing on disk."""

    def __init__(self, folder: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/0"
        self.folder = folder
        self.port = port
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> "PrivateRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(
                "bench/scale.py: redis-server is not installed (apt-get install redis)"
            )
        self.process = await asyncio.create_subprocess_exec(
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.folder),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        client = Redis.from_url(self.url)
        try:
            while True:
                try:
                    await client.ping()
                    return self
                except (OSError, RedisError):
                    if time.monotonic() > deadline:
                        raise
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def __aexit__(self, *exc_info: object) -> None:
        if self.process is not None:
            await stop(self.process)

    def cpu_s(self) -> float:
        return 0.0 if self.process is None else cpu_s(Path(f"/proc/{self.process.pid}/stat"))


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (a worker drains and leaves), then SIGKILL after 30 s."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout=30)
    except TimeoutError:
        process.kill()
        await process.wait()


@asynccontextmanager
async def workers_running(
    target: Target, count: int, tag: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """``count`` ``moorline worker`` processes, stopped (and waited for) on exit."""
    processes = []
    try:
        for index in range(count):
            with target.log(tag, index).open("wb") as log:
                processes.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable,
                        "-m",
                        "moorline",
                        "worker",
                        cwd=BENCH_DIR,
                        env=target.environment(),
                        stdout=log,
                        stderr=log,
                    )
                )
        yield processes
    finally:
        await asyncio.gather(*(stop(process) for process in processes))


# --- one drain ---------------------------------------------------------------------------------


async def enqueue(submitter: Moorline, tenants: Sequence[TenantId], kind: str, count: int) -> None:
    """``count`` runs of ``kind`` through ``app.submit_many``, the tenants taking turns.

    Each is delayed a day: :meth:`Drain.release` makes them due at once when every worker is up.
    """
    for index, offset in enumerate(range(0, count, BATCH)):
        size = min(BATCH, count - offset)
        batch = [Submission(workflow=kind, delay=HELD_S) for _ in range(size)]
        answers = await submitter.submit_many(batch, tenant=tenants[index % len(tenants)])
        refused = [answer for answer in answers if isinstance(answer, Exception)]
        if refused:
            raise SystemExit(f"bench/scale.py: a submission was refused: {refused[0]!r}")


class Drain:
    """Polls one connection for the counters while the workers drain."""

    def __init__(self, conn: AsyncConnection, probe: Probe, target: Target) -> None:
        self.conn = conn
        self.probe = probe
        self.target = target

    async def count(self, *statuses: str) -> int:
        """Runs in ``statuses`` (a count over the status index)."""
        query = select(func.count()).select_from(runs).where(runs.c.status.in_(statuses))
        try:
            return int((await self.conn.execute(query)).scalar_one())
        finally:
            # Each poll its own transaction: InnoDB's repeatable read would keep one count.
            await self.conn.rollback()

    async def sample(self, done: int, pids: list[int]) -> Sample:
        try:
            commits = await self.probe.commits(self.conn)
            threads = await self.probe.server_threads(self.conn)
        finally:
            await self.conn.rollback()
        redis = self.target.redis
        return Sample(
            at=time.perf_counter(),
            done=done,
            commits=commits,
            workers_cpu=sum(cpu_s(Path(f"/proc/{pid}/stat")) for pid in pids),
            server_cpu={path: cpu_s(path) for path in threads},
            redis_cpu=0.0 if redis is None else redis.cpu_s(),
            host=host_jiffies(),
        )

    async def release(self) -> None:
        """Make every queued run due now, in one statement (the workers wake within a poll)."""
        await self.conn.execute(
            update(runs).where(runs.c.status == "queued").values(not_before=utcnow())
        )
        await self.conn.commit()

    async def measure(self, workers: int, kind: str, total: int) -> Row:
        """Start ``workers`` processes, release the runs, sample at 10 % done and at the end."""
        succeeded = await self.count("succeeded")
        warm = max(1, int(total * WARM_UP_SHARE))
        start: Sample | None = None
        async with workers_running(self.target, workers, kind) as processes:
            pids = [process.pid for process in processes]
            await self.target.ready(processes, kind)
            await self.release()
            deadline = time.monotonic() + DEADLINE_S
            while True:
                # The runs left, not those done: a count that shrinks as the drain goes on.
                done = total - await self.count("queued", "running")
                if start is None and done >= warm:
                    if done >= total:
                        raise SystemExit(
                            "bench/scale.py: drained before the clock ran: raise --runs"
                        )
                    start = await self.sample(done, pids)
                if start is not None and done >= total:
                    end = await self.sample(done, pids)
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"bench/scale.py: {done} of {total} runs done in {DEADLINE_S} s"
                    )
                await asyncio.sleep(POLL_S)
        failed = total - (await self.count("succeeded") - succeeded)
        if failed:
            raise SystemExit(f"bench/scale.py: {failed} of {total} runs did not succeed")
        row = row_of((self.target.backend, kind, workers), start, end)
        return row


async def on_backend(backend: str, args: argparse.Namespace, folder: Path) -> list[Row]:
    """Every kind and worker count of ``backend``, on one fresh database."""
    counts = [n for n in args.workers if backend != "sqlite" or n <= SQLITE_WORKERS]
    if not counts:
        print(f"{LABELS[backend]:17} skipped: at most {SQLITE_WORKERS} workers on one file")
        return []

    async def on(url: str) -> list[Row]:
        db = DatabaseManager(Settings(database_url=url))
        redis = PrivateRedis(folder) if backend != "sqlite" else None
        rows = []
        try:
            await upgrade(db)
            tenants = [await seed_tenant(db, PLAN) for _ in range(TENANTS)]
            target = Target(backend, url, redis, folder)
            submitter = build_app(target.settings())
            async with running(redis), submitter, db.engine.connect() as conn:
                drain = Drain(conn, PROBES[backend](), target)
                for kind in args.kind:
                    for workers in counts:
                        await enqueue(submitter, tenants, kind, args.runs)
                        await analyze(db)
                        row = await drain.measure(workers, kind, args.runs)
                        print(line(row), flush=True)
                        rows.append(row)
        finally:
            await db.dispose()
        return rows

    return await on_fresh_database(backend, on)


@asynccontextmanager
async def running(redis: PrivateRedis | None) -> AsyncIterator[None]:
    """The private Redis running, if the backend has one."""
    if redis is None:
        yield
    else:
        async with redis:
            yield


# --- the table ---------------------------------------------------------------------------------

LABELS = {"postgresql": "postgresql+redis", "mysql": "mariadb+redis", "sqlite": "sqlite"}
HEADER = (
    f"{'backend':17} {'kind':4} {'workers':>7} {'runs/s':>8} {'commits/s':>9} "
    f"{'commits/run':>11} {'worker CPU':>10} {'db CPU':>7} {'redis CPU':>9} {'host %':>6}"
)
"""CPU columns are milliseconds per run."""


def line(row: Row) -> str:
    def number(value: float | None, width: int, digits: int) -> str:
        return f"{'n/a':>{width}}" if value is None else f"{value:{width}.{digits}f}"

    return (
        f"{LABELS[row.backend]:17} {row.kind:4} {row.workers:7d} {row.runs_per_s:8.1f} "
        f"{number(row.commits_per_s, 9, 0)} {number(row.commits_per_run, 11, 2)} "
        f"{row.worker_cpu_ms:10.2f} {number(row.db_cpu_ms, 7, 2)} "
        f"{number(row.redis_cpu_ms, 9, 3)} {row.host_busy * 100:6.0f}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def names(choices: Sequence[str]) -> Any:
        def parse(value: str) -> list[str]:
            found = [item.strip() for item in value.split(",") if item.strip()]
            wrong = [item for item in found if item not in choices]
            if wrong or not found:
                raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
            return found

        return parse

    def counts(value: str) -> list[int]:
        try:
            found = [int(item) for item in value.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError("a comma-separated list of numbers") from None
        if not found or min(found) < 1:
            raise argparse.ArgumentTypeError("numbers of 1 or more")
        return found

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends", type=names(tuple(PROBES)), default=["postgresql", "mysql", "sqlite"]
    )
    parser.add_argument("--workers", type=counts, default=[1, 2, 4, 8])
    parser.add_argument("--runs", type=int, default=None, help="Runs per drain (default 4000).")
    parser.add_argument("--kind", type=names(("noop", "io")), default=["noop", "io"])
    parser.add_argument("--quick", action="store_true", help="CI size: 200 runs per drain.")
    parser.add_argument("--json", type=Path, help="Also write the rows to this file.")
    args = parser.parse_args(argv)
    args.runs = args.runs or (200 if args.quick else 4000)
    if args.runs < 20:
        parser.error("--runs: at least 20, so that the clock has a window")
    return args


async def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"{args.runs} runs per drain; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; CPU columns in ms per run",
        flush=True,
    )
    print(HEADER, flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix=f"scale-{uuid.uuid4().hex[:6]}-") as name:
        folder = Path(name)
        (folder / "plans.yaml").write_text(PLANS_YAML, encoding="utf-8")
        for backend in args.backends:
            rows += await on_backend(backend, args, folder)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1), encoding="utf-8")


if __name__ == "__main__":
    asyncio.run(main())
