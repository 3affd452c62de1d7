"""Network partitions between hosts in namespaces (issue 22 item 3).

A "db" host runs a private database server and Redis, an "api" host a real ``moorline serve``,
and three worker hosts one ``moorline worker`` each (see :mod:`tests.netns`). Faults are
injected with ``iptables`` in the partitioned host's namespace, all at once: worker 1 cut off
from the database, worker 2 from Redis, the API process from both; worker 3 stays whole.
Checked for each fault:

- a worker cut off from its database stops its runs (self-fences) within its lease (drop);
- its runs are reclaimed and end exactly once elsewhere; after the heal the old worker writes
  nothing for the attempts it lost, and works again;
- the API answers 503 in bounded time while its database is unreachable (``/readyz``, an admin
  read, a tenant's trigger: never a hang), and answers again by itself after the heal;
- through 10 % loss every run still ends exactly once; behind 200 ms of delay (``test_delay``)
  a worker keeps its leases and the API answers.
"""

import asyncio
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from moorline.db.dsn import PROBE_TIMEOUT_S, UNACKNOWLEDGED_TIMEOUT_S
from moorline.db.manager import RETRY_ATTEMPTS, DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.runs import RunsRepo
from moorline.db.schema import events, runs
from moorline.settings import Settings
from moorline.types import TERMINAL_STATUSES, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.faults.harness import (
    LEASE_TTL_S,
    PLAN,
    RECOVERY_BOUND_S,
    REPO_ROOT,
    Workers,
    held_by,
    owner_pattern,
    submit,
    terminal_count,
    terminal_events,
)
from tests.helpers import FULL_SIZE, wait_for
from tests.netns import (
    REDIS_PORT,
    SERVER_PORTS,
    DatabaseHost,
    Host,
    Network,
    remove_stale,
    run,
    unavailable,
)
from tests.servers import is_listening, servers_required

logger = logging.getLogger(__name__)

pytestmark = pytest.mark.faults

ADMIN_TOKEN = "partition-admin-token"
API_PORT = 8000
RUNS = 40 if FULL_SIZE else 12
RUN_S = 6.0
"""How long one run takes: long enough that worker 1 holds runs when the partition starts."""
FENCE_SLACK_S = 1.5
"""Beyond the lease, for the test's polling and a loaded machine to see the fence."""
API_ANSWER_S = (
    UNACKNOWLEDGED_TIMEOUT_S
    + (RETRY_ATTEMPTS + 1) * PROBE_TIMEOUT_S
    + (2**RETRY_ATTEMPTS - 1) * Settings().db_retry_base
    + 5.0
)
"""How long a request may take while the database is unreachable: the statement in flight
fails when its data goes unacknowledged, then every retry of ``with_retry`` waits out its
connection probe and its backoff; plus slack for a loaded machine. An answer, not a hang."""
WORKER_HOSTS = ("w1", "w2", "w3")
"""Worker 1 is cut off from the database, worker 2 from Redis; worker 3 stays whole."""
DELAYED_HOST = "wd"
"""The host of the delay test: one more worker and API process, behind a delay proxy."""
DELAYED_LEASE_TTL_S = 10.0
"""The delayed worker's lease. With the other workers' 3 s, 200 ms on every request made it
self-fence its runs (a renewal is several round trips, queued behind the runs' own writes, and
must come back within 5/6 of the TTL): safe, as fencing holds, but it finished few runs. With
10 s, as with the default 90 s, it keeps them all."""
CI_CASES = (("postgresql", "drop"), ("mysql", "drop"), ("mysql", "loss"), ("postgresql", "delay"))
"""What ``make test`` runs; ``MOORLINE_FULL=1`` runs every fault on both backends."""
TERMINAL = [status.value for status in TERMINAL_STATUSES]
SELF_FENCED = "stopping, lease lost: no renewal in time (self-fenced)"


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = unavailable()
    if reason is not None:
        if servers_required():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    stale = remove_stale()
    if stale:
        logger.warning("removed what a killed test run left: %s", ", ".join(stale))
    made = Network()
    try:
        made.open()
        for role in ("db", "api", *WORKER_HOSTS, DELAYED_HOST):
            made.add(role)
        yield made
    finally:
        made.close()
        left = made.leftovers()
        assert not left, f"left behind: {left}"


@pytest.fixture(scope="module", params=["postgresql", "mysql"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def wait_listening(host: str, port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_listening(host, port):
        assert time.monotonic() < deadline, f"nothing listens on {host}:{port}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def db_host(network: Network, backend: str) -> Iterator[DatabaseHost]:
    folder = tempfile.mkdtemp(prefix="mln-", dir="/tmp")
    made = DatabaseHost(network.hosts["db"], backend, folder)
    shutil.chown(folder, user=made.server_user)
    try:
        made.start()
        wait_listening(made.host.address, SERVER_PORTS[backend])
        wait_listening(made.host.address, REDIS_PORT)
        if backend == "mysql":
            run(["mariadb", "-h", made.host.address, "-uroot", "-e", "CREATE DATABASE moorline"])
        asyncio.run(_upgrade(made.database_url))
        yield made
    finally:
        made.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def _upgrade(url: str) -> None:
    manager = DatabaseManager(Settings(database_url=url))
    try:
        await upgrade(manager)
    finally:
        await manager.dispose()


@pytest.fixture(scope="module")
def database_url(db_host: DatabaseHost) -> str:
    return db_host.database_url


@dataclass
class Deployment:
    """The API process and the workers, each on a host of its own."""

    network: Network
    db_host: DatabaseHost
    workers: Workers
    """The worker processes, then the API processes (see :func:`start_api`)."""
    api: subprocess.Popen[bytes]

    @property
    def api_url(self) -> str:
        return f"http://{self.network.hosts['api'].address}:{API_PORT}"

    def host(self, role: str) -> Host:
        return self.network.hosts[role]

    def worker_log(self, index: int) -> str:
        return self.workers.log(self.workers.procs[index])


@pytest.fixture(scope="module")
def deployment(
    network: Network, db_host: DatabaseHost, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    folder: Path = tmp_path_factory.mktemp("partitions")
    workers = Workers(
        db_host.database_url,
        folder,
        slots=RUNS // len(WORKER_HOSTS),  # so each worker takes a share of the runs
        redis_url=db_host.redis_url,
        redis_prefix="mlnp",
        extra_env={"MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN},
        measured=False,  # killed at the end: see Workers.measured
    )
    api_host = network.hosts["api"]
    try:
        for role in WORKER_HOSTS:
            workers.start(network.hosts[role].wrap([]))
        api = start_api(workers, api_host, api_host.wrap([]))
        yield Deployment(network, db_host, workers, api)
    finally:
        workers.kill_all()


def start_api(workers: Workers, host: Host, wrapper: Sequence[str]) -> subprocess.Popen[bytes]:
    """``moorline serve`` on ``host``, one of ``workers.procs`` (killed with them)."""
    # Named as a worker's log, so Workers.log reads it.
    with (workers.folder / f"worker-{len(workers.procs)}.log").open("wb") as log:
        api = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "moorline", "serve", "--workers", "0",
             "--host", host.address, "--port", str(API_PORT), "--app", workers.app],
            cwd=REPO_ROOT, env=workers.env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    workers.procs.append(api)
    return api


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


async def request(
    client: httpx.AsyncClient, method: str, path: str, **kwargs: Any
) -> tuple[int, float]:
    """(status, seconds) of one request; a hang fails the test after API_ANSWER_S."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(API_ANSWER_S):
            response = await client.request(method, path, **kwargs)
    except TimeoutError:
        raise AssertionError(f"{method} {path} hung for {API_ANSWER_S}s") from None
    return response.status_code, time.monotonic() - started


async def written_after_reclaim(db: DatabaseManager, lost: Sequence[tuple[str, int]]) -> list[str]:
    """Events of a lost attempt written after its ``reclaimed`` event: the old worker's."""
    found: list[str] = []
    async with db.connect() as conn:
        for run_id, attempt in lost:
            rows = list(
                await conn.execute(
                    select(events.c.type, events.c.created_at)
                    .where(events.c.run_id == run_id, events.c.attempt == attempt)
                    .order_by(events.c.seq)
                )
            )
            reclaims = [row.created_at for row in rows if row.type == "reclaimed"]
            assert reclaims, f"run {run_id} attempt {attempt} was never reclaimed"
            found += [
                f"{run_id}/{attempt}: {row.type}" for row in rows if row.created_at > reclaims[0]
            ]
    return found


async def api_answers(client: httpx.AsyncClient, path: str, wanted: int) -> bool:
    try:
        status, _ = await request(client, "GET", path)
    except httpx.ConnectError:  # not listening yet
        return False
    return status == wanted


def ci_sized(backend: str, fault: str) -> None:
    """Skip the cases CI leaves to ``MOORLINE_FULL=1``, to keep the module within its budget."""
    if not FULL_SIZE and (backend, fault) not in CI_CASES:
        pytest.skip(f"{fault} on {backend} runs with MOORLINE_FULL=1 (CI runs {CI_CASES})")


async def serving(deployment: Deployment, client: httpx.AsyncClient) -> None:
    workers = deployment.workers
    started = [proc for proc in workers.procs if "worker" in proc.args]  # type: ignore[operator]
    await wait_for(
        lambda: asyncio.to_thread(lambda: all(workers.is_serving(p) for p in started)),
        timeout_s=60,
        message="the workers to serve",
    )
    await wait_for(
        lambda: api_answers(client, "/readyz", 200), timeout_s=60, message="the API ready"
    )


async def tenant_key(client: httpx.AsyncClient) -> str:
    """The API key of a new tenant, made through the API (the private database goes with the
    module, so nothing purges it)."""
    body = {"name": f"partition-{uuid.uuid4().hex[:8]}", "plan": PLAN}
    response = await client.post("/v1/admin/tenants", json=body)
    assert response.status_code == 201, response.text
    key: str = response.json()["api_key"]
    return key


async def answers(client: httpx.AsyncClient, key: str, label: str) -> list[int]:
    """The statuses of ``/readyz``, an admin read and a tenant's trigger (the database and
    Redis's quota), asked at once."""
    trigger = {"json": {"input": {"seconds": 0.1}}, "headers": {"Authorization": f"Bearer {key}"}}
    asked: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/readyz", {}),
        ("GET", "/v1/admin/runs?limit=1", {}),
        ("POST", "/v1/workflows/work/runs", trigger),
    ]
    found = await asyncio.gather(
        *(request(client, method, path, **kwargs) for method, path, kwargs in asked)
    )
    for (method, path, _), (status, took) in zip(asked, found, strict=True):
        print(f"{label} API: {method} {path} answered {status} in {took:.1f}s")
    return [status for status, _ in found]


async def self_fenced(workers: Workers, proc: subprocess.Popen[bytes], count: int) -> None:
    await wait_for(
        lambda: asyncio.to_thread(lambda: workers.log(proc).count(SELF_FENCED) >= count),
        timeout_s=LEASE_TTL_S + FENCE_SLACK_S,
        message="worker 1 to self-fence",
    )


async def all_ended(db: DatabaseManager, run_ids: Sequence[str], timeout_s: float) -> None:
    try:
        await wait_for(
            lambda: _equal(terminal_count(db, run_ids), len(run_ids)),
            timeout_s=timeout_s,
            message="every run to end",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; not ended: {await unended(db, run_ids)}") from None


async def unended(db: DatabaseManager, run_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """Each unfinished run's status, attempt, lease owner and lease expiry: what a failure says."""
    async with db.connect() as conn:
        rows = await conn.execute(
            select(
                runs.c.status, runs.c.attempt, runs.c.lease_owner, runs.c.lease_expires_at
            ).where(runs.c.id.in_(run_ids), runs.c.status.not_in(TERMINAL))
        )
        return [tuple(str(value) for value in row) for row in rows]


async def ended_once(db: DatabaseManager, run_ids: Sequence[str]) -> None:
    """Every run succeeded, and ended exactly once."""
    ended = await terminal_events(db, run_ids)
    assert set(ended) == set(run_ids)
    assert [run_id for run_id, count in ended.items() if count != 1] == []
    async with db.connect() as conn:
        statuses = Counter(
            row.status
            for row in await conn.execute(select(runs.c.status).where(runs.c.id.in_(run_ids)))
        )
    assert statuses == Counter({RunStatus.SUCCEEDED.value: len(run_ids)})


@pytest.mark.parametrize("fault", ["drop", "loss"])
async def test_partitions(
    fault: str, deployment: Deployment, db: DatabaseManager, tenants: Tenants
) -> None:
    ci_sized(deployment.db_host.backend, fault)
    workers = deployment.workers
    w1 = workers.procs[0]
    db_peer = deployment.host("db")
    db_port = SERVER_PORTS[deployment.db_host.backend]
    async with api_client(deployment.api_url) as client:
        await serving(deployment, client)
        key = await tenant_key(client)
        tenant_ids = [await tenants.new(PLAN) for _ in range(3)]
        run_ids = await submit(RunsRepo(db), tenant_ids, "work", [{"seconds": RUN_S}] * RUNS)
        held = await wait_for(
            lambda: held_by(db, owner_pattern(w1)), timeout_s=30, message="worker 1 to hold runs"
        )
        fenced_before = workers.log(w1).count(SELF_FENCED)
        cut = time.monotonic()
        deployment.network.partition(deployment.host("w1"), db_peer, [db_port], fault)
        deployment.network.partition(deployment.host("w2"), db_peer, [REDIS_PORT], fault)
        deployment.network.partition(deployment.host("api"), db_peer, [db_port, REDIS_PORT], fault)
        try:
            # At once: the API's answers, worker 1's fence, and every run's end, those of
            # worker 1 elsewhere when its leases were lost.
            answering = asyncio.create_task(answers(client, key, fault))
            checks = [all_ended(db, run_ids, RUN_S * 4 + RECOVERY_BOUND_S)]
            if fault == "drop":
                # Worker 1 stops its runs before its lease can expire.
                checks.append(self_fenced(workers, w1, fenced_before + len(held)))
            try:
                await asyncio.gather(*checks)
            except AssertionError:
                for index, proc in enumerate(workers.procs):
                    tail = workers.log(proc).splitlines()[-25:]
                    print(f"--- worker {index + 1} (pid {proc.pid}):", *tail, sep="\n")
                raise
            statuses = await answering
            # The API answers 503, not a hang, while its database is unreachable; through a
            # 10 % loss it answers, slower.
            assert statuses == ([503, 503, 503] if fault == "drop" else statuses), statuses
            assert set(statuses) <= {200, 202, 503}, statuses
        finally:
            for role in ("w1", "w2", "api"):
                deployment.network.heal(deployment.host(role))
        healed = time.monotonic()
        # The API is back by itself.
        await wait_for(
            lambda: api_answers(client, "/readyz", 200), timeout_s=30, message="the API back"
        )
        assert await answers(client, key, "healed") == [200, 200, 202]
        # Worker 1 works again: it takes runs of its own after the heal (more runs than the
        # other two have slots, each long enough that they cannot take the rest before worker
        # 1's next claim: up to its 5 s backoff after the failed ones of the partition).
        more = await submit(RunsRepo(db), tenant_ids, "work", [{"seconds": RUN_S}] * RUNS)
        try:
            await wait_for(
                lambda: held_by(db, owner_pattern(w1)),
                timeout_s=30,
                message="worker 1 working again",
            )
        except AssertionError:
            for index, proc in enumerate(workers.procs):
                tail = workers.log(proc).splitlines()[-40:]
                print(f"--- worker {index + 1} (pid {proc.pid}):", *tail, sep="\n")
            raise
        await all_ended(db, more, RUN_S * 2 + RECOVERY_BOUND_S)
    if fault == "drop":
        # Its lost attempts got nothing written after their reclaim, heal or not.
        assert await written_after_reclaim(db, held) == []
    await ended_once(db, [*run_ids, *more])
    print(f"{fault}: cut for {healed - cut:.1f}s while worker 1 held {len(held)} runs")


@dataclass
class Delayed:
    """The delayed host's proxy, worker and API process."""

    proxy: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    api_url: str


@pytest.fixture
def delayed(deployment: Deployment, tmp_path: Path) -> Iterator[Delayed]:
    ci_sized(deployment.db_host.backend, "delay")  # before anything starts
    host, db_peer = deployment.host(DELAYED_HOST), deployment.host("db")
    db_port = SERVER_PORTS[deployment.db_host.backend]
    workers = deployment.workers
    started = len(workers.procs)
    with (tmp_path / "proxy.log").open("wb") as log:
        proxy = subprocess.Popen(
            host.wrap([sys.executable, "-m", "tests.delay_proxy", host.address, db_peer.address,
                       str(db_port), str(REDIS_PORT)]),
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_listening(host.address, REDIS_PORT)
        # The delayed host's worker and API reach both servers through the proxy.
        through = host.wrap([
            "env",
            "MOORLINE_DATABASE_URL="
            + deployment.db_host.database_url.replace(db_peer.address, host.address),
            f"MOORLINE_REDIS_URL=redis://{host.address}:{REDIS_PORT}/0",
        ])  # fmt: skip
        worker = workers.start([*through, f"MOORLINE_LEASE_TTL={DELAYED_LEASE_TTL_S}"])
        start_api(workers, host, through)
        yield Delayed(proxy, worker, f"http://{host.address}:{API_PORT}")
    finally:
        for proc in [proxy, *workers.procs[started:]]:
            proc.kill()
            proc.wait()
        del workers.procs[started:]


async def test_delay(
    deployment: Deployment, delayed: Delayed, db: DatabaseManager, tenants: Tenants
) -> None:
    """A worker and an API process whose requests reach the database and Redis 200 ms late:
    leases hold (no self-fence), every run ends exactly once, the API answers 200."""
    workers = deployment.workers
    async with api_client(delayed.api_url) as client:
        await serving(deployment, client)
        key = await tenant_key(client)
        delayed.proxy.send_signal(signal.SIGUSR1)
        tenant_ids = [await tenants.new(PLAN) for _ in range(3)]
        run_ids = await submit(
            RunsRepo(db), tenant_ids, "work", [{"seconds": RUN_S / 2}] * (RUNS * 2)
        )
        held = await wait_for(
            lambda: held_by(db, owner_pattern(delayed.worker)),
            timeout_s=30,
            message="the delayed worker to hold runs",
        )
        answering = asyncio.create_task(answers(client, key, "delayed"))
        await all_ended(db, run_ids, RUN_S * 4 + RECOVERY_BOUND_S)
        assert await answering == [200, 200, 202]
    assert SELF_FENCED not in workers.log(delayed.worker)
    await ended_once(db, run_ids)
    print(f"delay: the delayed worker held {len(held)} runs and kept every lease")


async def _equal(value: Awaitable[int], wanted: int) -> bool:
    return await value == wanted


def api_client(url: str) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=API_ANSWER_S + 5)
