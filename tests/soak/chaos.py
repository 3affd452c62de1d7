"""The chaos soak: real processes on PostgreSQL + Redis, under steady load, with faults injected.

Three ``moorline worker`` processes and one ``moorline serve --workers 0`` API process share a
fresh PostgreSQL database and a *private* ``redis-server`` (on a free port, in a temporary
folder: restarting it must not disturb the shared Redis other tests use). Runs of the soak app
(:mod:`tests.soak.app`) are submitted through HTTP, each with an idempotency key so a
submission retried after an error (the API lost its database connection, say) can never make a
second run.

**Calibration** first: runs are fed through the API so that every worker slot always has work,
and the drain rate of this very setup (same processes, slots, workflow, machine, API) is
measured over ``calibration_s`` once all three workers serve, without faults. The load then
arrives open-loop at ``load_share`` (70 %) of that rate, as docs/reliability.md J1 asks: enough to
keep every process busy, with headroom for the faults.
Meanwhile:

- every 5-20 s a random serving worker is killed with SIGKILL and a new one started in its
  place; a worker that exits on its own is restarted too (as a supervisor would) and noted;
- every minute (the first time 20 s in) the private Redis is killed and started again, empty;
- every 2-6 s one or two random connections to the soak's database are ended with
  ``pg_terminate_backend`` (never other databases' connections).

None of the soak's processes is measured by coverage: every one of them is killed with SIGKILL
(the faults, then the teardown), so a traced process never writes its data and the tracing
would only slow it down.

Worker 0 is never killed: it is the *memory sentinel*, whose resident set size (read from
``/proc``) after warm-up is compared with its size at the end, as is the API process's; a
worker killed every few seconds never lives long enough to say anything about leaks.

At the end the load stops, the faults stop, every submitted run must reach a terminal status,
and the history checker (:mod:`tests.soak.history`) looks for runs lost or doubled and steps
run again after their checkpoint; no key in the soak's Redis may be without a TTL.
"""

import asyncio
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.schema import runs
from moorline.settings import Settings
from moorline.types import TERMINAL_STATUSES
from tests.faults.harness import PLAN, REPO_ROOT, Workers
from tests.private_redis import PrivateRedis
from tests.servers import PG_ADMIN_URL, run_sql, unique_name
from tests.soak.history import History, check

ADMIN_TOKEN = "soak-admin-token"
WORKERS = 3
SENTINEL = 0
"""Index of the worker that is never killed (the memory sentinel)."""
IN_FLIGHT = 64
"""Most submissions out at once (see :meth:`Soak.submit_one`), within httpx's connections."""


@dataclass(frozen=True)
class SoakConfig:
    """How long and how hard; the defaults are the CI size."""

    load_s: float = 110.0
    """How long runs are submitted (faults are injected over the same span): two Redis
    restarts at the CI size, the last one half a minute before the end."""
    rate: float | None = None
    """Runs submitted per second; None: ``load_share`` of the drain rate calibration measures."""
    load_share: float = 0.7
    calibration_s: float = 10.0
    """How long the calibration measures the drain rate."""
    calibration_warm_s: float = 3.0
    """Calibration load before the measurement starts (pools, caches, the first claims)."""
    backlog_per_slot: int = 2
    """Runs submitted and unfinished per worker slot while calibrating: never an idle slot."""
    redis_every_s: float = 60.0
    """Redis is restarted every this many seconds of load, ..."""
    redis_first_s: float = 20.0
    """... the first time this long after the load starts."""
    steps: int = 3
    step_s: float = 0.2
    kill_every_s: tuple[float, float] = (5.0, 20.0)
    terminate_every_s: tuple[float, float] = (2.0, 6.0)
    warm_up_s: float = 25.0
    """RSS is compared from this long after the load starts (imports, pools, caches settled)."""
    drain_timeout_s: float = 150.0
    """Longest wait for the backlog after the load (it ends as soon as every run is terminal):
    on a machine loaded by other work, or after a kill that cost a worker's start-up, the load
    can outrun what the faults left of the drain rate for a while."""
    slots: int = 10
    lease_ttl_s: float = 15.0
    """Longer than the fault tests' 3 s: with five processes on two loaded cores, a heartbeat
    can wait seconds for the CPU, and a lease that lapses on a live worker is not the fault
    under test. A killed worker's runs are back within this plus the reaper interval."""
    seed: int | None = None


@dataclass
class SoakResult:
    """What the soak did and found."""

    config: SoakConfig
    drain_rate: float = 0.0
    """Runs per second the calibration measured (no faults, no submissions meanwhile)."""
    rate: float = 0.0
    """Runs per second submitted during the load."""
    submitted: int = 0
    submit_retries: int = 0
    kills: int = 0
    crashes: list[str] = field(default_factory=list)
    """Workers that exited without being killed (restarted, as a supervisor would): the last
    error line of each one's log."""
    redis_restarts: int = 0
    planned_redis_restarts: int = 0
    terminated_connections: int = 0
    drained_after_s: float = 0.0
    elapsed_s: float = 0.0
    history: History | None = None
    keys_without_ttl: list[str] = field(default_factory=list)
    rss_growth: dict[str, float] = field(default_factory=dict)
    """Process name → (RSS at the end / RSS after warm-up) - 1."""

    def describe(self) -> str:
        growth = ", ".join(f"{name} {share:+.1%}" for name, share in self.rss_growth.items())
        if self.drain_rate:
            share = f"{self.rate / self.drain_rate:.0%} of"
        else:
            share = "(no calibration)"
        lines = [
            f"calibration: drain rate {self.drain_rate:.1f} runs/s ({WORKERS} workers x "
            f"{self.config.slots} slots, fed through the API, {self.config.calibration_s:g} s, "
            "no faults)",
            f"soak: {self.config.load_s:.0f} s of load at {self.rate:.1f} runs/s ({share} the "
            f"drain rate), {self.elapsed_s:.0f} s in all; drained {self.drained_after_s:.1f} s "
            "after the load",
            f"submitted {self.submitted} (retried submissions {self.submit_retries}); faults: "
            f"{self.kills} worker kills, {self.redis_restarts} Redis restarts (of "
            f"{self.planned_redis_restarts} planned), "
            f"{self.terminated_connections} database connections terminated",
            f"worker crashes (exited unkilled, restarted) {len(self.crashes)}"
            + "".join(f"\n    {line}" for line in self.crashes),
            f"keys without TTL {len(self.keys_without_ttl)}; RSS growth after warm-up: {growth}",
        ]
        if self.history is not None:
            lines.append(self.history.describe())
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` from ``/proc`` (None when it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


@contextmanager
def soak_database() -> Iterator[str]:
    """A fresh PostgreSQL database for the soak, dropped afterwards."""
    name = unique_name("moorline_soak")
    run_sql("postgresql", f"CREATE DATABASE {name}")
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        run_sql("postgresql", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Soak:
    """One soak run; :meth:`run` does everything and returns the :class:`SoakResult`."""

    def __init__(self, config: SoakConfig, database_url: str, folder: Path) -> None:
        self.config = config
        self.database_url = database_url
        self.database = make_url(database_url).database
        self.folder = folder
        self.random = random.Random(config.seed)
        self.result = SoakResult(config)
        self.redis = PrivateRedis(folder)
        self.log = folder / "executions.log"
        self.api_port = free_port()
        self.api: subprocess.Popen[bytes] | None = None
        self.workers = Workers(
            database_url,
            folder,
            slots=config.slots,
            grace_s=1.0,
            app="tests.soak.app:app",
            extra_env={
                "MOORLINE_SOAK_LOG": str(self.log),
                "MOORLINE_LEASE_TTL": str(config.lease_ttl_s),
            },
            measured=False,
        )
        self.slots: list[subprocess.Popen[bytes]] = []
        self.run_ids: dict[str, str] = {}
        self.in_flight = asyncio.Semaphore(IN_FLIGHT)
        self.rss: dict[str, list[tuple[float, int]]] = {}
        self.loading = True

    # --- processes ---------------------------------------------------------------------------

    def start_api(self) -> None:
        env = self.workers.env()
        env.update(MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN)
        log = (self.folder / "api.log").open("wb")
        self.api = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moorline",
                "serve",
                "--workers",
                "0",
                "--port",
                str(self.api_port),
                "--app",
                "tests.soak.app:app",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    async def wait_serving(self, client: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                if (await client.get("/readyz")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.api is not None and self.api.poll() is not None:
                raise AssertionError((self.folder / "api.log").read_text())
            if time.monotonic() > deadline:
                raise AssertionError("the API did not become ready in 60 s")
            await asyncio.sleep(0.1)

    async def wait_workers_serving(self) -> None:
        deadline = time.monotonic() + 60
        while not all(self.workers.is_serving(proc) for proc in self.slots):
            if time.monotonic() > deadline:
                raise AssertionError("the workers did not start serving in 60 s")
            await asyncio.sleep(0.1)

    def teardown(self) -> None:
        self.workers.kill_all()
        if self.api is not None and self.api.poll() is None:
            self.api.kill()
            self.api.wait(10)
        self.redis.stop()

    # --- load --------------------------------------------------------------------------------

    async def tenant_keys(self, client: httpx.AsyncClient, count: int = 2) -> list[str]:
        keys = []
        for index in range(count):
            response = await client.post(
                "/v1/admin/tenants",
                json={"name": f"soak-{index}-{os.getpid()}", "plan": PLAN},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )
            assert response.status_code == 201, response.text
            keys.append(response.json()["api_key"])
        return keys

    async def submit_one(self, client: httpx.AsyncClient, key: str, index: int) -> None:
        """Submit run ``index`` until the API accepts it; the idempotency key makes retries safe.

        At most :data:`IN_FLIGHT` requests are out at once; the others wait here, in order.
        Handing httpx thousands of requests for its 100 connections instead (a backlog after
        a Redis restart at 30 triggers/s) makes its pool's bookkeeping quadratic: this process
        then spends its CPU assigning requests to connections and sends none (seen in CI,
        where coverage slows this process several times). The 60 s a submission may be
        refused count from its first request actually sent.
        """
        body = {
            "input": {"steps": self.config.steps, "step_s": self.config.step_s},
            "idempotency_key": f"soak-{index}",
        }
        deadline: float | None = None
        answers: list[str] = []
        while True:
            async with self.in_flight:
                began = time.monotonic()
                deadline = deadline or began + 60
                try:
                    response = await client.post(
                        "/v1/workflows/soak/runs",
                        json=body,
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    if response.status_code in (200, 202):
                        self.run_ids[f"soak-{index}"] = response.json()["run_id"]
                        return
                    assert response.status_code >= 500, response.text
                    answer = f"{response.status_code} {response.text[:200]}"
                except httpx.TransportError as exc:
                    answer = f"{type(exc).__name__}: {exc}"
            answers.append(
                f"+{began - deadline + 60:.1f}s ({time.monotonic() - began:.1f}s) {answer}"
            )
            self.result.submit_retries += 1
            if time.monotonic() > deadline:
                raise AssertionError(self.refused(index, answers))
            await asyncio.sleep(0.2)

    def refused(self, index: int, answers: list[str]) -> str:
        """Why submission ``index`` gave up: its answers, the API's state and its last errors."""
        api = "running" if self.api is not None and self.api.poll() is None else "exited"
        log = (self.folder / "api.log").read_text(errors="replace").splitlines()
        problems = [line for line in log if " WARNING " in line or " ERROR " in line]
        return "\n".join(
            [
                f"submission soak-{index} refused for 60 s; the API process has {api}",
                f"its {len(answers)} answers (seconds since its first try, duration):",
                *(f"  {answer}" for answer in answers[-12:]),
                f"the API's last warnings and errors ({len(problems)} in all):",
                *(f"  {line[:300]}" for line in problems[-25:]),
                "the API log's last lines:",
                *(f"  {line[:300]}" for line in log[-15:]),
            ]
        )

    async def load(
        self, client: httpx.AsyncClient, keys: list[str], rate: float, first: int
    ) -> None:
        """Open-loop arrivals at ``rate`` per second for ``load_s`` seconds, from run ``first``."""
        pending: set[asyncio.Task[None]] = set()
        count = int(self.config.load_s * rate)
        began = time.monotonic()
        for offset in range(count):
            delay = began + offset / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            index = first + offset
            task = asyncio.create_task(self.submit_one(client, keys[index % len(keys)], index))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
        self.result.submitted = len(self.run_ids)

    async def calibrate(self, client: httpx.AsyncClient, keys: list[str]) -> float:
        """The drain rate of this setup, in runs per second, before any fault.

        Runs are fed through the API so that ``backlog_per_slot`` runs per worker slot are
        always submitted and not yet finished: the workers never wait for work, and the API
        and this process do their share of the work as during the load. The rate is the
        runs finished during ``calibration_s``, counted from ``calibration_warm_s`` after
        every worker serves (start-up and ramp-up excluded), by polling the database.
        """
        await self.wait_workers_serving()
        backlog = WORKERS * self.config.slots * self.config.backlog_per_slot
        db = DatabaseManager(Settings(database_url=self.database_url))
        terminal = [status.value for status in TERMINAL_STATUSES]
        query = select(func.count()).select_from(runs).where(runs.c.status.in_(terminal))
        feeding: set[asyncio.Task[None]] = set()
        began = time.monotonic() + self.config.calibration_warm_s
        ends = began + self.config.calibration_s
        first: tuple[float, int] | None = None
        index = 0
        try:
            while True:
                async with db.connect() as conn:
                    done = int(await conn.scalar(query) or 0)
                now = time.monotonic()
                if first is None and now >= began:
                    first = (now, done)
                if first is not None and now >= ends:
                    return (done - first[1]) / (now - first[0])
                while index - done < backlog:
                    task = asyncio.create_task(
                        self.submit_one(client, keys[index % len(keys)], index)
                    )
                    feeding.add(task)
                    task.add_done_callback(feeding.discard)
                    index += 1
                await asyncio.sleep(0.1)
        finally:
            await asyncio.gather(*feeding)
            await db.dispose()

    # --- faults ------------------------------------------------------------------------------

    async def supervise(self) -> None:
        """Restart a worker that exited on its own, and note why it did (its last error)."""
        while True:
            await asyncio.sleep(0.5)
            for index, proc in enumerate(self.slots):
                if proc.poll() is not None:
                    lines = self.workers.log(proc).splitlines()
                    errors = [line for line in lines if " CRITICAL " in line] or [
                        line for line in lines if " ERROR " in line
                    ]
                    why = errors[-1] if errors else f"exit status {proc.returncode}"
                    self.result.crashes.append(f"worker pid {proc.pid}: {why[:300]}")
                    self.slots[index] = self.workers.start()

    async def kill_workers(self) -> None:
        while True:
            await asyncio.sleep(self.random.uniform(*self.config.kill_every_s))
            # Only a worker that is serving: one killed while it still imports (several
            # seconds on a loaded machine) tests nothing and leaves the soak without workers.
            serving = [
                index
                for index in range(WORKERS)
                if index != SENTINEL
                and self.slots[index].poll() is None
                and self.workers.is_serving(self.slots[index])
            ]
            if not serving:
                continue
            victim_slot = self.random.choice(serving)
            victim = self.slots[victim_slot]
            # Replaced before the kill, so the supervisor never sees the slot's dead process.
            self.slots[victim_slot] = self.workers.start()
            victim.kill()
            await asyncio.to_thread(victim.wait)
            self.result.kills += 1

    def planned_redis_restarts(self) -> int:
        first, every = self.config.redis_first_s, self.config.redis_every_s
        return max(0, math.ceil((self.config.load_s - first) / every))

    async def restart_redis(self) -> None:
        """Kill Redis and start it again, empty: ``redis_first_s`` in, then every minute."""
        first, every = self.config.redis_first_s, self.config.redis_every_s
        began = time.monotonic()
        self.result.planned_redis_restarts = self.planned_redis_restarts()
        for index in range(self.result.planned_redis_restarts):
            await asyncio.sleep(max(0.0, began + first + index * every - time.monotonic()))
            await self.redis.restart()
            self.result.redis_restarts += 1

    async def terminate_connections(self) -> None:
        """End one or two random backends of the soak's database (workers' and API's)."""
        while True:
            await asyncio.sleep(self.random.uniform(*self.config.terminate_every_s))
            sql = (
                "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity "
                f"WHERE datname = '{self.database}' AND pid <> pg_backend_pid() "
                f"ORDER BY random() LIMIT {self.random.choice((1, 2))}) AS victims"
            )
            done = await asyncio.to_thread(
                subprocess.run,
                ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-tAc", sql],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            self.result.terminated_connections += int(done.stdout.strip() or 0)

    async def sample_rss(self, started: float) -> None:
        """Sample the sentinel's and the API's RSS every second.

        Samples are kept per process id: a sentinel that crashed and was restarted is a new
        process, measured from its own warm-up (or not at all when too young).
        """
        assert self.api is not None
        api = self.api.pid
        while True:
            sentinel = self.slots[SENTINEL].pid
            for name, pid in ((f"worker 0 (sentinel, pid {sentinel})", sentinel), ("api", api)):
                kib = rss_kib(pid)
                if kib is not None:
                    self.rss.setdefault(name, []).append((time.monotonic() - started, kib))
            await asyncio.sleep(1.0)

    def rss_growth(self) -> dict[str, float]:
        """Median RSS over the last 10 s of load against the 10 s after warm-up, per process.

        Warm-up counts from the process's first sample (a restarted sentinel is young); a
        process too young for both windows is not measured.
        """
        growth = {}
        end = self.config.load_s
        for name, samples in self.rss.items():
            warm = samples[0][0] + self.config.warm_up_s
            if warm + 10 > end - 10:
                continue
            after_warm_up = [kib for at, kib in samples if warm <= at < warm + 10]
            last = [kib for at, kib in samples if end - 10 <= at <= end]
            if after_warm_up and last:
                growth[name] = statistics.median(last) / statistics.median(after_warm_up) - 1
        return growth

    # --- the whole soak ----------------------------------------------------------------------

    async def run(self) -> SoakResult:
        began = time.monotonic()
        db = DatabaseManager(Settings(database_url=self.database_url))
        try:
            await upgrade(db)
        finally:
            await db.dispose()
        self.redis.launch()
        self.workers.redis_url = self.redis.url
        self.workers.redis_prefix = "soak"
        try:
            await self.redis.wait_ready()
            self.start_api()
            self.slots = [self.workers.start() for _ in range(WORKERS)]
            base = f"http://127.0.0.1:{self.api_port}"
            limits = httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
            async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:
                await self.wait_serving(client)
                keys = await self.tenant_keys(client)
                self.result.drain_rate = await self.calibrate(client, keys)
                rate = self.config.rate or self.config.load_share * self.result.drain_rate
                self.result.rate = rate
                started = time.monotonic()
                chaos = [
                    asyncio.create_task(self.supervise()),
                    asyncio.create_task(self.kill_workers()),
                    asyncio.create_task(self.restart_redis()),
                    asyncio.create_task(self.terminate_connections()),
                    asyncio.create_task(self.sample_rss(started)),
                ]
                try:
                    await self.load(client, keys, rate, first=len(self.run_ids))
                finally:
                    for task in chaos:
                        task.cancel()
                    await asyncio.gather(*chaos, return_exceptions=True)
            self.result.rss_growth = self.rss_growth()
            loaded = time.monotonic()
            await self.wait_drained()
            self.result.drained_after_s = time.monotonic() - loaded
            self.result.keys_without_ttl = await self.keys_without_ttl()
        finally:
            self.teardown()
        self.result.history = await check(self.database_url, list(self.run_ids.values()), self.log)
        self.result.elapsed_s = time.monotonic() - began
        return self.result

    async def wait_drained(self) -> None:
        """Poll until every submitted run is terminal (or the drain timeout passes)."""
        ids = list(self.run_ids.values())
        db = DatabaseManager(Settings(database_url=self.database_url))
        deadline = time.monotonic() + self.config.drain_timeout_s
        terminal = [status.value for status in TERMINAL_STATUSES]
        try:
            while time.monotonic() < deadline:
                async with db.connect() as conn:
                    done = await conn.scalar(
                        select(func.count())
                        .select_from(runs)
                        .where(runs.c.id.in_(ids), runs.c.status.in_(terminal))
                    )
                if done == len(ids):
                    return
                await asyncio.sleep(0.5)
        finally:
            await db.dispose()

    async def keys_without_ttl(self) -> list[str]:
        client = Redis.from_url(self.redis.url, decode_responses=True)
        try:
            return [key async for key in client.scan_iter() if await client.ttl(key) == -1]
        finally:
            await client.aclose()


def run_soak(config: SoakConfig, folder: Path) -> SoakResult:
    """Run one soak on a fresh database (dropped afterwards) with its files in ``folder``."""
    with soak_database() as url:
        return asyncio.run(Soak(config, url, folder).run())


def stop_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt so ``make soak`` interrupted still cleans up."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
