"""Trigger latency and throughput of one ``moorline serve`` process (issue 5's targets).

Starts a real ``moorline serve --workers 0`` (API and reaper, no worker loop, so nothing but
admission competes with the triggers) on a fresh database, creates a tenant whose plan never
binds (rate limit and quota far above the load), then has ``C`` concurrent clients, in this
process, each send ``POST /v1/workflows/echo/runs`` one after another until ``--triggers`` are
accepted. Latency is measured at the client, request sent to response parsed. Each (backend, C)
is measured ``--rounds`` times after a warm-up; the table shows the median of the rounds with
min and max.

``--client`` chooses what sends the requests. ``raw`` (the default): one kept-alive HTTP/1.1
connection per concurrent client, a request written as bytes and the answer's status, headers
and JSON body read back (anything but 202 fails the benchmark). ``moorline``: the product's
``moorline.Client`` (httpx), the whole client path. On a machine whose cores the client shares
with the server, httpx's CPU per request (about as much as the server's, on two cores) is a
large part of what the latency measures; ``raw`` takes most of it away, so the figures are the
server's.

Backends: ``sqlite`` (a file, no Redis) and ``postgresql`` (with Redis, a fresh key prefix);
``floor`` measures :func:`floor_app`, the same route with nothing behind it, the least a
trigger can cost through uvicorn and FastAPI on this machine.
Targets (issue 5): at 8 clients p50 <= 5 ms and p99 <= 20 ms; at 64 clients >= 800
triggers/s, on SQLite; the same p50 on PostgreSQL + Redis.

The client shares the machine with the server, so on a small machine the figures are a lower
bound of what the server alone could do. The last columns are the CPU time per accepted trigger
of the server process (all its threads, from ``/proc``) and of this client process, medians of
the rounds: steadier than latency on a busy machine, and they tell which side is the limit.
``--profile DIR`` runs the server under cProfile and writes ``DIR/<backend>.prof`` at its exit,
to find the trigger path's hot spots.

``--baseline DIR`` compares this source tree with another one (a ``git worktree`` of the
commit to compare against): both servers run side by side, each on its own database and Redis
prefix, and their rounds alternate, so that both see the same moments of a machine whose speed
drifts from minute to minute. Each (backend, C) then has two lines, ``this`` and ``baseline``,
and the ratio of their medians.

    .venv/bin/python bench/api.py [--triggers 2000] [--warmup 200] [--rounds 3]
        [--clients 8,64] [--backends sqlite,postgresql] [--client raw|moorline]
        [--profile DIR] [--baseline DIR]
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
from common import on_fresh_database, percentile, summary
from redis.asyncio import Redis
from scale_counters import cpu_s

from moorline import Client

REDIS_URL = os.environ.get("MOORLINE_BENCH_REDIS", "redis://127.0.0.1:6379/0")
ADMIN_TOKEN = "bench-admin-token"
PLANS_YAML = """
plans:
  bench:
    lane: workflow_bench
    priority: 50
    daily_quota: 100000000
    rate_limit: "1000000/second"
    tenant_concurrency: 8
    lane_slots: 8
"""
STARTUP_S = 60.0
SOURCE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Round:
    """One measured round: latencies (ms), the rate, CPU per trigger (server, client)."""

    latencies_ms: list[float]
    rate_per_s: float
    server_cpu_ms: float
    client_cpu_ms: float

    def percentile(self, share: float) -> float:
        return percentile(self.latencies_ms, share)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``; 0 elsewhere)."""
    return cpu_s(Path(f"/proc/{pid}/stat"))


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@asynccontextmanager
async def serving(
    settings: dict[str, str],
    profile: Path | None,
    *,
    floor: bool = False,
    source: Path = SOURCE_ROOT,
    workers: int = 0,
) -> AsyncIterator[Server]:
    """A ``moorline serve --workers 0`` process with ``settings``: its URL and pid
    (``workers``: worker loops in the process, none by default).

    With ``floor``, uvicorn serving :func:`floor_app` instead, with uvicorn's own defaults:
    uvloop, httptools, and an access-log line per request. ``serve`` writes no line for an
    accepted trigger (``MOORLINE_ACCESS_LOG=errors``), so it pays less than the floor for that.
    """
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    env.update(settings)
    profiler = [] if profile is None else ["-m", "cProfile", "-o", str(profile)]
    command = [sys.executable, *profiler]
    if floor:
        command += ["-m", "uvicorn", "api:floor_app", "--factory"]
        command += ["--app-dir", str(source / "bench")]
        command += ["--loop", "uvloop", "--http", "httptools", "--port", str(port)]
    else:
        command += ["-m", "moorline", "serve", "--port", str(port), "--workers", str(workers)]
    # The server's log goes to a file: a pipe nobody reads fills up (64 KiB of access log
    # lines) and then blocks the server's event loop on its next log write.
    log = tempfile.TemporaryFile()
    process = await asyncio.create_subprocess_exec(
        *command,
        env=env,
        # In the source tree: ``python -m`` puts the working directory first on sys.path, so
        # from anywhere else the server would import that directory's moorline, not source's.
        cwd=source,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, process, log)
        yield Server(url=url, pid=process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=60)
        except TimeoutError:
            process.kill()
            await process.wait()
        log.close()


async def wait_ready(url: str, process: asyncio.subprocess.Process, log: IO[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_S
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as http:
        while True:
            if process.returncode is not None:
                log.seek(0)
                raise SystemExit(f"moorline serve exited: {log.read().decode()}")
            try:
                if (await http.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("moorline serve did not become ready")
            await asyncio.sleep(0.1)


TRIGGER_PATH = "/v1/workflows/echo/runs"
TRIGGER_BODY = b'{"input":{"message":"bench"}}'

Send = Callable[[], Awaitable[None]]
"""One trigger, sent and its answer read; the loops of a round each get one."""


class RawConnection:
    """One kept-alive HTTP/1.1 connection that sends the same trigger again and again."""

    def __init__(self, url: str, api_key: str) -> None:
        parts = urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._request = (
            f"POST {TRIGGER_PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(TRIGGER_BODY)}\r\n\r\n"
        ).encode() + TRIGGER_BODY
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def trigger(self) -> None:
        """Send the trigger and read its answer.

        Raises:
            RuntimeError: the answer is not 202 with a run id.
        """
        if self._streams is None or self._streams[0].at_eof():
            # Not yet open, or closed by the server after its keep-alive timeout (idle between
            # two rounds).
            self._streams = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._streams
        writer.write(self._request)
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        length = 0
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        if status_line.split(" ", 2)[1] != "202" or "run_id" not in json.loads(body):
            raise RuntimeError(f"trigger answered {status_line}: {body[:300]!r}")

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            writer.close()
            await writer.wait_closed()


async def trigger_round(senders: list[Send], triggers: int, server_pid: int) -> Round:
    """``triggers`` accepted triggers sent by one concurrent loop per sender."""
    cpu_before, client_before = cpu_seconds(server_pid), time.process_time()
    remaining = triggers
    latencies: list[float] = []

    async def loop(send: Send) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            await send()
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(loop(send) for send in senders))
    elapsed = time.perf_counter() - started
    return Round(
        latencies_ms=latencies,
        rate_per_s=triggers / elapsed,
        server_cpu_ms=(cpu_seconds(server_pid) - cpu_before) * 1000 / triggers,
        client_cpu_ms=(time.process_time() - client_before) * 1000 / triggers,
    )


def floor_app() -> Any:
    """The floor: an app with the trigger's route, body and answer, and nothing behind them.

    What the HTTP server, FastAPI and pydantic cost per trigger on this machine, measured by
    the same client (``--backends floor``): no authentication, admission or database.
    """
    from fastapi import FastAPI
    from pydantic import BaseModel, Field

    class Body(BaseModel):
        input: dict[str, Any] = Field(default_factory=dict)
        idempotency_key: str | None = None

    class Accepted(BaseModel):
        run_id: str
        workflow: str
        status: str

    app = FastAPI()

    @app.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(TRIGGER_PATH.replace("echo", "{workflow}"), status_code=202)
    async def trigger(workflow: str, body: Body) -> Accepted:
        return Accepted(run_id=str(uuid.uuid4()), workflow=workflow, status="queued")

    return app


async def measure(
    servers: list[Server], args: argparse.Namespace, *, floor: bool = False
) -> list[dict[int, list[Round]]]:
    """The rounds of each server; with several, their rounds alternate (see ``--baseline``)."""
    keys = ["none"] * len(servers)
    if not floor:
        for index, server in enumerate(servers):
            async with Client(server.url, admin_token=ADMIN_TOKEN) as admin:
                tenant = await admin.create_tenant(f"bench-{uuid.uuid4().hex[:8]}", "bench")
            keys[index] = tenant.api_key
    results: list[dict[int, list[Round]]] = [{} for _ in servers]
    async with AsyncExitStack() as stack:
        for clients in args.clients:
            senders = [
                await senders_for(server, key, clients, args.client, stack)
                for server, key in zip(servers, keys, strict=True)
            ]
            for server, sending in zip(servers, senders, strict=True):
                await trigger_round(sending, args.warmup, server.pid)
                results[servers.index(server)][clients] = []
            for _ in range(args.rounds):
                for index, server in enumerate(servers):
                    rounds = results[index][clients]
                    rounds.append(await trigger_round(senders[index], args.triggers, server.pid))
    return results


async def senders_for(
    server: Server, api_key: str, clients: int, kind: str, stack: AsyncExitStack
) -> list[Send]:
    """One sender per concurrent client, closed with ``stack``."""
    if kind == "moorline":
        client = await stack.enter_async_context(Client(server.url, api_key, timeout_s=60.0))

        async def send() -> None:
            await client.trigger("echo", {"message": "bench"})

        return [send] * clients
    connections = [RawConnection(server.url, api_key) for _ in range(clients)]
    for connection in connections:
        stack.push_async_callback(connection.close)
    return [connection.trigger for connection in connections]


async def run_backend(
    backend: str, args: argparse.Namespace, root: Path, sources: list[Path]
) -> list[dict[int, list[Round]]]:
    """Start one server per source tree on ``backend``, then measure them together."""
    if backend == "floor":
        async with AsyncExitStack() as stack:
            servers = [
                await stack.enter_async_context(serving({}, None, floor=True, source=source))
                for source in sources
            ]
            return await measure(servers, args, floor=True)

    async def start(servers: list[Server]) -> list[dict[int, list[Round]]]:
        if len(servers) == len(sources):
            return await measure(servers, args)
        source = sources[len(servers)]

        async def on(url: str) -> list[dict[int, list[Round]]]:
            settings = {
                "MOORLINE_DATABASE_URL": url,
                "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN,
                "MOORLINE_PLANS_FILE": str(root / "plans.yaml"),
                "MOORLINE_APP": "moorline.examples.app:app",
            }
            prefix = f"bench_{uuid.uuid4().hex[:10]}"
            if backend == "postgresql":
                await upgrade_with(source, url)
                settings |= {"MOORLINE_REDIS_URL": REDIS_URL, "MOORLINE_REDIS_PREFIX": prefix}
            profile = None
            if args.profile is not None:
                profile = args.profile / f"{backend}{'' if not servers else '-baseline'}.prof"
            try:
                async with serving(settings, profile, source=source) as server:
                    return await start([*servers, server])
            finally:
                if backend == "postgresql":
                    await delete_keys(prefix)

        return await on_fresh_database(backend, on)

    return await start([])


async def upgrade_with(source: Path, url: str) -> None:
    """Migrate the database at ``url`` with ``source``'s own migrations (``moorline db
    upgrade`` run in that tree): a baseline refuses a schema a newer tree migrated."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOORLINE_")}
    env["MOORLINE_DATABASE_URL"] = url
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "moorline",
        "db",
        "upgrade",
        cwd=source,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, error = await process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"moorline db upgrade in {source} failed: {error.decode()}")


WITH_REDIS = "+redis"
"""A backend named ``X+redis`` (``postgresql+redis``): the database X, with Redis beside it."""


@asynccontextmanager
async def redis_beside(backend: str, name: str) -> AsyncIterator[dict[str, str]]:
    """The ``MOORLINE_*`` settings that add Redis for a backend ``X+redis``, else none.

    Under a fresh key prefix (``name`` and a random suffix), whose keys are deleted at the end.
    """
    if not backend.endswith(WITH_REDIS):
        yield {}
        return
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    try:
        yield {"MOORLINE_REDIS_URL": REDIS_URL, "MOORLINE_REDIS_PREFIX": prefix}
    finally:
        await delete_keys(prefix)


async def delete_keys(prefix: str) -> None:
    redis = Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)]
        for start in range(0, len(keys), 500):
            await redis.delete(*keys[start : start + 500])
    finally:
        await redis.aclose()


def report(backend: str, results: list[dict[int, list[Round]]]) -> None:
    label = {"sqlite": "sqlite", "floor": "floor (no app)"}.get(backend, "postgresql+redis")
    if len(results) == 1:
        report_lines(label, results[0])
        return
    this, baseline = results
    report_lines(f"{label} this", this)
    report_lines(f"{label} baseline", baseline)
    for clients in this:

        def ratio(of: Callable[[Round], float], clients: int = clients) -> float:
            return statistics.median(map(of, this[clients])) / statistics.median(
                map(of, baseline[clients])
            )

        ratios = [
            ratio(lambda r: r.percentile(0.50)),
            ratio(lambda r: r.rate_per_s),
            ratio(lambda r: r.server_cpu_ms),
        ]
        print(
            f"{label:26} {clients:3} clients  this / baseline: p50 {ratios[0]:.2f}, "
            f"triggers/s {ratios[1]:.2f}, server CPU per trigger {ratios[2]:.2f}",
            flush=True,
        )


def report_lines(label: str, results: dict[int, list[Round]]) -> None:
    for clients, rounds in results.items():
        p50 = [r.percentile(0.50) for r in rounds]
        p99 = [r.percentile(0.99) for r in rounds]
        rate = [r.rate_per_s for r in rounds]
        server = statistics.median(r.server_cpu_ms for r in rounds)
        client = statistics.median(r.client_cpu_ms for r in rounds)
        print(
            f"{label:26} {clients:3} clients  p50 {summary(p50, ' ms'):24}  "
            f"p99 {summary(p99, ' ms'):24}  {summary(rate)}  "
            f"CPU/trigger server {server:.2f} ms, client {client:.2f} ms",
            flush=True,
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triggers", type=int, default=2000, help="Triggers per round.")
    parser.add_argument("--warmup", type=int, default=200, help="Unmeasured triggers first.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--clients", type=lambda text: [int(n) for n in text.split(",")], default=[8, 64]
    )
    parser.add_argument(
        "--backends", type=lambda text: text.split(","), default=["sqlite", "postgresql"]
    )
    parser.add_argument(
        "--client",
        choices=["raw", "moorline"],
        default="raw",
        help="raw: one kept-alive HTTP/1.1 connection per client; moorline: moorline.Client.",
    )
    parser.add_argument("--profile", type=Path, default=None, help="Directory for cProfile.")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="Another source tree to measure side by side, rounds alternating.",
    )
    args = parser.parse_args()
    sources = [SOURCE_ROOT] if args.baseline is None else [SOURCE_ROOT, args.baseline.resolve()]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    print(
        f"{args.triggers} triggers per round, {args.client} client, "
        f"median (min, max) of {args.rounds} rounds; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "plans.yaml").write_text(PLANS_YAML, encoding="utf-8")
        for backend in args.backends:
            report(backend, await run_backend(backend, args, root, sources))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
