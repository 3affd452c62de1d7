"""Redis run as in production, from Debian's packages, on free ports in a test's own folder.

- :class:`SentinelRedis`: a master, one replica and three sentinels (``redis-sentinel``)
  watching it under the service name ``moorline``, with a one-second failure detection so a
  fail-over takes a few seconds. :meth:`SentinelRedis.kill_master` is the fault.
- :class:`ClusterRedis`: six ``redis-server --cluster-enabled yes`` nodes joined by
  ``redis-cli --cluster create ... --cluster-replicas 1``: three masters, three replicas.

Both keep nothing on disk that outlives the test, and :meth:`stop` kills every process they
started (``kill -9`` by process id), whatever state the test left them in; use them as context
managers, or through the module-scoped fixtures ``sentinel_redis`` and ``cluster_redis`` below
(``tests/conftest.py`` imports them, so every test package has them).
"""

import asyncio
import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Self

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from tests.helpers import port_is_free
from tests.servers import servers_required

Check = Callable[[], Awaitable[bool]]

SERVICE = "moorline"
DOWN_AFTER_MS = 1000
"""Sentinel's failure detection: a master silent this long is subjectively down."""
CLUSTER_NODE_TIMEOUT_MS = 2000
START_TIMEOUT_S = 60.0


PORTS_FROM = 12000
PORTS_PER_PROCESS = 500
"""Each test process takes its servers' ports from its own block of 500 above 12,000, counting
up, so no two servers of one run are given one port. Asking the kernel for a free port instead
(bind to 0) can hand the same port out twice in a row, and hands out ports from the range that
outgoing connections use; a cluster node's bus port is its port + 10,000, so blocks and buses all
stay below that range (32,768 on Linux). A block is used round, a stopped server's port again."""
_next_port: Iterator[int] | None = None


def _port_block() -> Iterator[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = PORTS_FROM + (int(worker) if worker.isdigit() else 0) % 20 * PORTS_PER_PROCESS
    return itertools.cycle(range(first, first + PORTS_PER_PROCESS))


def free_port(*, bus: bool = False) -> int:
    """The next port of this process's block that nobody listens on; with ``bus``, port + 10000
    is free too (a cluster node's bus)."""
    global _next_port
    if _next_port is None:
        _next_port = _port_block()
    for port in itertools.islice(_next_port, PORTS_PER_PROCESS):
        if port_is_free(port) and (not bus or port_is_free(port + 10000)):
            return port
    raise RuntimeError(f"none of this test process's {PORTS_PER_PROCESS} Redis ports is free")


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} is not installed (apt-get install -y redis-server redis-sentinel)"
        )
    return found


class _Processes:
    """The processes of one topology; :meth:`stop` kills them all."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, port: int, args: list[str], name: str) -> None:
        if port in self.procs:
            raise RuntimeError(f"port {port} is given to two servers")
        with (self.folder / f"{name}-{port}.log").open("ab") as log:
            self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def kill(self, port: int) -> None:
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
            for path in sorted(self.folder.glob("*.log"))
        )


async def ask(port: int, *command: str) -> object:
    """One command to the server on ``port``; its reply decoded."""
    client = Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2.0)
    try:
        reply: object = await client.execute_command(*command)  # type: ignore[no-untyped-call]
        return reply
    finally:
        await client.aclose()


async def wait_until(what: str, check: Check, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``check`` until it is true (a Redis error counts as not yet) or fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await check():
                return
        except (OSError, RedisError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def server_args(port: int, folder: Path, *extra: str) -> list[str]:
    return [
        binary("redis-server"),
        *("--port", str(port), "--bind", "127.0.0.1"),
        *("--save", "", "--appendonly", "no", "--dir", str(folder)),
        # A replica syncs at once rather than after the default 5 s wait for others.
        *("--repl-diskless-sync-delay", "0"),
        *extra,
    ]


class _Topology:
    """Redis servers started together: ``async with`` starts them and stops them all, even
    when the start fails half-way."""

    processes: _Processes

    async def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.processes.stop()

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class SentinelRedis(_Topology):
    """A master, a replica and three sentinels; :attr:`url` is the ``redis+sentinel://`` URL."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes = _Processes(folder)
        self.master_port = free_port()
        self.replica_port = free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        sentinels = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        self.url = f"redis+sentinel://{sentinels}/{SERVICE}/0"

    async def start(self) -> None:
        processes = self.processes
        processes.spawn(
            self.master_port, server_args(self.master_port, self.folder), "redis-master"
        )
        processes.spawn(
            self.replica_port,
            server_args(
                self.replica_port,
                self.folder,
                *("--replicaof", "127.0.0.1", str(self.master_port)),
            ),
            "redis-replica",
        )
        for port in self.sentinel_ports:
            config = self.folder / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            processes.spawn(port, [binary("redis-sentinel"), str(config)], "sentinel")
        await wait_until("the replica to sync", self._replica_synced)
        await wait_until("the sentinels to know each other and the replica", self._watched)

    async def _replica_synced(self) -> bool:
        info = await ask(self.replica_port, "INFO", "replication")
        return isinstance(info, dict) and info.get("master_link_status") == "up"

    async def _watched(self) -> bool:
        for port in self.sentinel_ports:
            master = (await _sentinel_masters(port))[SERVICE]
            if int(str(master["num-other-sentinels"])) < 2 or int(str(master["num-slaves"])) < 1:
                return False
        return True

    async def master(self) -> int:
        """The master's port, as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                address = await ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            except (OSError, RedisError):
                continue
            assert isinstance(address, list | tuple), address
            return int(address[1])
        raise RuntimeError("no sentinel answers")

    async def kill_master(self, timeout_s: float = 30.0) -> int:
        """``kill -9`` the master; return the new master's port once the sentinels promoted it."""
        old = await self.master()
        self.processes.kill(old)

        async def promoted() -> bool:
            if await self.master() == old:
                return False
            info = await ask(await self.master(), "INFO", "replication")
            return isinstance(info, dict) and info.get("role") == "master"

        await wait_until("the sentinels to promote the replica", promoted, timeout_s)
        return await self.master()


async def _sentinel_masters(port: int) -> dict[str, dict[str, object]]:
    """``SENTINEL MASTERS`` of the sentinel on ``port``, by name."""
    client = Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2.0)
    try:
        masters = await client.sentinel_masters()
        assert isinstance(masters, dict)
        return masters
    finally:
        await client.aclose()


class ClusterRedis(_Topology):
    """Six cluster nodes, three masters with a replica each; :attr:`url` is ``redis+cluster://``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes = _Processes(folder)
        self.ports = [free_port(bus=True) for _ in range(6)]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:3])

    async def start(self) -> None:
        for port in self.ports:
            self.processes.spawn(
                port,
                server_args(
                    port,
                    self.folder,
                    *("--cluster-enabled", "yes"),
                    *("--cluster-config-file", str(self.folder / f"nodes-{port}.conf")),
                    *("--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)),
                ),
                "cluster-node",
            )
        for port in self.ports:
            await wait_until(f"node {port} to answer", _pings(port))
        create = await asyncio.create_subprocess_exec(
            binary("redis-cli"),
            "--cluster",
            "create",
            *(f"127.0.0.1:{port}" for port in self.ports),
            *("--cluster-replicas", "1", "--cluster-yes"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(create.communicate(), START_TIMEOUT_S)
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{output.decode()}")
        await wait_until("every node to see the cluster ok", self._all_ok)

    async def _all_ok(self) -> bool:
        for port in self.ports:
            text = str(await ask(port, "CLUSTER", "INFO"))
            info = dict(line.split(":", 1) for line in text.split() if ":" in line)
            if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != "6":
                return False
        return True


def _pings(port: int) -> Check:
    async def check() -> bool:
        return bool(await ask(port, "PING"))

    return check


def _require_binaries() -> None:
    missing = [
        name for name in ("redis-server", "redis-sentinel", "redis-cli") if not shutil.which(name)
    ]
    if not missing:
        return
    message = f"{', '.join(missing)} missing: apt-get install -y redis-server redis-sentinel"
    if servers_required():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _start_apart(topology: _Topology) -> None:
    """Start ``topology`` in a loop of its own, on a thread; a failed start says what its
    servers logged.

    A fixture asked for from an async test (``request.getfixturevalue``) is set up while that
    test's loop runs, where ``asyncio.run`` would refuse.
    """
    with ThreadPoolExecutor(1) as thread:
        try:
            thread.submit(asyncio.run, topology.start()).result()
        except Exception as exc:
            raise RuntimeError(f"{exc}; the servers' logs:\n{topology.processes.logs()}") from exc


@pytest.fixture(scope="module")
def sentinel_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelRedis]:
    """A Sentinel-watched master and replica for the test module (started in its own loop)."""
    _require_binaries()
    topology = SentinelRedis(tmp_path_factory.mktemp("sentinel"))
    try:
        _start_apart(topology)
        yield topology
    finally:
        topology.stop()


@pytest.fixture(scope="module")
def cluster_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterRedis]:
    """A six-node Redis Cluster for the test module (started in its own loop)."""
    _require_binaries()
    topology = ClusterRedis(tmp_path_factory.mktemp("cluster"))
    try:
        _start_apart(topology)
        yield topology
    finally:
        topology.stop()
