"""Admission under concurrency: exact quotas, one run per key, no unit lost or left over.

The tests run on the issue's two deployment shapes: embedded (SQLite, quota counted in the
database, rate limits in memory) and scaled out (PostgreSQL with Redis, counters in Redis, as
``moorline serve`` with ``MOORLINE_REDIS_URL`` set). The database counter's SQL is held to its
contract on every backend in ``tests/contract/test_admission_repos.py``. After every Redis
test no quota or rate-limit key may lack a TTL (docs/reliability.md F1).
"""

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from redis.asyncio import Redis

from moorline.admission.admit import Admission
from moorline.admission.gate import RedisGate
from moorline.admission.quotas import DatabaseQuotaStore, QuotaStore, RedisQuotaStore
from moorline.admission.ratelimit import RateLimiter
from moorline.admission.triggers import Admitted, Trigger
from moorline.db.manager import DatabaseManager
from moorline.db.repos.announcements import Announcement
from moorline.db.repos.listing import RunListing
from moorline.db.repos.quotas import QuotaClaim
from moorline.db.repos.records import Run
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.db.repos.tenants import TenantsRepo
from moorline.dispatch.days import quota_day
from moorline.dispatch.submit import Submitter
from moorline.errors import RateLimited
from moorline.plans import PlansProvider
from moorline.runtime.redis_client import RedisClient
from moorline.settings import Settings
from moorline.types import RunStatus, TenantId
from tests.api import workflows
from tests.api.conftest import ADMIN, Api, MakeApi
from tests.conftest import CAPABILITIES
from tests.helpers import wait_for
from tests.runtime.conftest import delete_keys, keys_under, keys_without_ttl
from tests.servers import REDIS_TEST_URL, require_server, unique_name

FULL = os.environ.get("MOORLINE_FULL") == "1"
TRIGGERS = 2000 if FULL else 200
SAME_KEY = 1000 if FULL else 100
QUOTA = 50  # the sandbox plan's, in tests/api/conftest.py


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    """The two deployment shapes: embedded, and a server database with Redis."""
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def api_database_url(database_url: str) -> str:
    return database_url


@dataclass
class Deployment:
    """What the backend's deployment counts with: Redis (a prefix of its own) or nothing."""

    redis: RedisClient | None
    prefix: str
    url: str = REDIS_TEST_URL
    """``MOORLINE_REDIS_URL`` (``test_admission_topologies.py``: Sentinel's, Cluster's)."""

    @property
    def settings(self) -> dict[str, Any]:
        if self.redis is None:
            return {}
        return {"redis_url": self.url, "redis_prefix": self.prefix}

    async def immortal_keys(self) -> list[str]:
        return [] if self.redis is None else await keys_without_ttl(self.redis, self.prefix)


@pytest.fixture
async def deployment(backend: str) -> AsyncIterator[Deployment]:
    if "server" not in CAPABILITIES[backend]:
        yield Deployment(redis=None, prefix="")
        return
    require_server("redis")
    client = Redis.from_url(REDIS_TEST_URL, decode_responses=True)
    prefix = unique_name("mo_api")
    try:
        yield Deployment(redis=client, prefix=prefix)
        assert await keys_without_ttl(client, prefix) == []
    finally:
        await delete_keys(client, prefix)
        await client.aclose()


async def test_concurrent_triggers_admit_exactly_the_quota(
    make_api: MakeApi, deployment: Deployment
) -> None:
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("sandbox")
        answers = await asyncio.gather(
            *(api.trigger(caller, input={"message": str(i)}) for i in range(TRIGGERS))
        )
        statuses = Counter(answer.status_code for answer in answers)
        assert statuses == {202: QUOTA, 429: TRIGGERS - QUOTA}
        refused = [answer.json()["error"] for answer in answers if answer.status_code == 429]
        assert {error["code"] for error in refused} == {"quota_exceeded"}
        assert await api.count_runs(caller, RunStatus.QUEUED) == QUOTA
        assert await api.count_runs(caller, RunStatus.RATE_LIMITED) == TRIGGERS - QUOTA
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert (usage["used_today"], usage["remaining"]) == (QUOTA, 0)
        if deployment.redis is not None:
            keys = await keys_under(deployment.redis, deployment.prefix)
            assert any(":quota:" in key for key in keys)
            assert any(":ratelimit:" in key for key in keys)
        assert await deployment.immortal_keys() == []


async def test_one_idempotency_key_posted_concurrently_is_one_run(
    make_api: MakeApi, deployment: Deployment
) -> None:
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("sandbox")
        body = {"input": {"message": "once"}, "idempotency_key": "deploy-42"}
        answers = await asyncio.gather(
            *(
                api.client.post("/v1/workflows/echo/runs", json=body, headers=caller.headers)
                for _ in range(SAME_KEY)
            )
        )
        assert Counter(answer.status_code for answer in answers) == {202: 1, 200: SAME_KEY - 1}
        assert len({answer.json()["run_id"] for answer in answers}) == 1
        assert await api.count_runs(caller) == 1
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert usage["used_today"] == 1
        other = await api.trigger(caller, input={"message": "twice"}, idempotency_key="deploy-42")
        assert other.status_code == 409


async def test_clients_that_go_away_mid_request_lose_no_unit(
    make_api: MakeApi, deployment: Deployment
) -> None:
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("sandbox")
        requests: list[asyncio.Future[Any]] = []
        stop = asyncio.Event()

        async def send() -> None:
            # Paced rather than all at once: a batch of admissions stores every run sent with
            # it in one transaction, so clients sent together would all be answered together,
            # before any of them could go away mid-request. Sent until the clients have gone
            # (at least twice the quota), so that some request is always in flight.
            i = 0
            while not stop.is_set() or i < QUOTA * 2:
                trigger = api.trigger(caller, input={"message": str(i)})
                requests.append(asyncio.ensure_future(trigger))
                i += 1
                await asyncio.sleep(0.002)

        sending = asyncio.ensure_future(send())

        async def admitting_with_some_in_flight() -> bool:
            usage = await api.client.get("/v1/usage", headers=caller.headers)
            # Read after the await, and acted on with no await in between: the requests seen
            # in flight here are still in flight when they are cancelled.
            return bool(usage.json()["used_today"] >= 5) and any(not r.done() for r in requests)

        await wait_for(admitting_with_some_in_flight, message="admissions with some in flight")
        gone = [request for request in requests if not request.done()][::2]
        for request in gone:
            request.cancel()
        stop.set()
        await sending
        await asyncio.gather(*requests, return_exceptions=True)
        assert any(request.cancelled() for request in gone)
        await api.app.state.services.admission.close()  # decisions of departed clients end

        queued = await api.count_runs(caller, RunStatus.QUEUED)
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert usage["used_today"] == queued == QUOTA  # every unit has its run, and vice versa
        assert await deployment.immortal_keys() == []


class RacingQuotas(DatabaseQuotaStore):
    """Counts in the database; on consume, first lets "another API process" store ``rival``.

    That is the interleaving the unique idempotency key must decide: both processes found no
    run under the key, both take a unit, only one run can be stored.
    """

    def __init__(self, db: DatabaseManager, rival: NewRun) -> None:
        super().__init__(db)
        self._db = db
        self._rival: NewRun | None = rival

    async def consume(self, tenant_id: TenantId, day: str, limit: int) -> int | None:
        rival, self._rival = self._rival, None
        if rival is not None:
            await RunsRepo(self._db).submit_many([rival])
        return await super().consume(tenant_id, day, limit)


async def admission_over(
    db: DatabaseManager,
    submitter: Submitter,
    quotas: QuotaStore,
    rate_limiter: RateLimiter | None = None,
) -> Admission:
    runs = RunsRepo(db)
    return Admission(
        runs=runs,
        listing=RunListing(db),
        submitter=submitter,
        quotas=quotas,
        rate_limiter=rate_limiter or RateLimiter(Settings()),
    )


async def test_a_trigger_that_loses_the_key_race_gives_its_unit_back(
    make_api: MakeApi,
) -> None:
    async with make_api() as api:
        caller = await api.tenant("sandbox")
        tenant_id = TenantId(caller.tenant_id)
        plan = await PlansProvider(api.settings).get("sandbox")
        rival = NewRun(
            tenant_id=tenant_id,
            workflow="echo",
            input={"message": "hi"},
            lane=plan.lane,
            idempotency_key="race",
        )
        quotas = RacingQuotas(api.db, rival)
        submitter = Submitter(RunsRepo(api.db))
        admission = await admission_over(api.db, submitter, quotas)
        trigger = Trigger(
            tenant_id=tenant_id,
            plan=plan,
            rate_identity="test",
            workflow=workflows.app.get("echo"),
            input={"message": "hi"},
            idempotency_key="race",
        )
        try:
            admitted = await admission.admit(trigger)
        finally:
            await submitter.close()
        assert not admitted.created
        assert admitted.run.idempotency_key == "race"
        assert await quotas.used(tenant_id, quota_day(admitted.run.created_at)) == 0
        assert await api.count_runs(caller) == 1


async def test_a_run_that_cannot_be_stored_gives_its_unit_back(make_api: MakeApi) -> None:
    async with make_api() as api:
        caller = await api.tenant("sandbox")
        tenant_id = TenantId(caller.tenant_id)
        submitter = Submitter(RunsRepo(api.db))
        await submitter.close()  # every submission now fails, after the unit was taken
        quotas = DatabaseQuotaStore(api.db)
        admission = await admission_over(api.db, submitter, quotas)
        trigger = Trigger(
            tenant_id=tenant_id,
            plan=await PlansProvider(api.settings).get("sandbox"),
            rate_identity="test",
            workflow=workflows.app.get("echo"),
            input={},
        )
        with pytest.raises(RuntimeError, match="closed"):
            await admission.admit(trigger)
        usage = await admission.usage(tenant_id, await PlansProvider(api.settings).get("sandbox"))
        assert usage.used_today == 0
        assert await api.count_runs(caller) == 0
        assert await TenantsRepo(api.db).get(tenant_id) is not None


class RacingRuns(RunsRepo):
    """Before its first batch, lets "another API process" store ``rival`` (quota taken with
    runs: the unit is taken in the batch's transaction, after the idempotency check)."""

    def __init__(self, db: DatabaseManager, rival: NewRun) -> None:
        super().__init__(db)
        self._rival: NewRun | None = rival

    async def submit_many(
        self,
        new: Sequence[NewRun],
        *,
        quotas: Sequence[QuotaClaim | None] | None = None,
        announcement: Announcement | None = None,
    ) -> list[Run]:
        rival, self._rival = self._rival, None
        if rival is not None:
            await RunsRepo(self._db).submit_many([rival])
        return await super().submit_many(new, quotas=quotas, announcement=announcement)


async def lost_race(api: Api, tenant_id: TenantId, key: str) -> tuple[Trigger, Submitter]:
    """A sandbox trigger of ``echo`` under ``key``, and a Submitter before whose first batch
    "another API process" stores a run of the same trigger under the key."""
    plan = await PlansProvider(api.settings).get("sandbox")
    rival = NewRun(
        tenant_id=tenant_id,
        workflow="echo",
        input={"message": "hi"},
        lane=plan.lane,
        idempotency_key=key,
    )
    trigger = Trigger(
        tenant_id=tenant_id,
        plan=plan,
        rate_identity="test",
        workflow=workflows.app.get("echo"),
        input={"message": "hi"},
        idempotency_key=key,
    )
    return trigger, Submitter(RacingRuns(api.db, rival))


async def test_with_units_taken_with_runs_a_lost_key_race_or_a_failed_store_takes_no_unit(
    make_api: MakeApi,
) -> None:
    async with make_api() as api:
        caller = await api.tenant("sandbox")
        tenant_id = TenantId(caller.tenant_id)
        quotas = DatabaseQuotaStore(api.db, taken_with_runs=True)
        trigger, racing = await lost_race(api, tenant_id, "race")
        try:
            admitted = await (await admission_over(api.db, racing, quotas)).admit(trigger)
        finally:
            await racing.close()
        assert not admitted.created and admitted.run.idempotency_key == "race"
        day = quota_day(admitted.run.created_at)
        assert await quotas.used(tenant_id, day) == 0
        closed = Submitter(RunsRepo(api.db))
        await closed.close()
        with pytest.raises(RuntimeError, match="closed"):
            await (await admission_over(api.db, closed, quotas)).admit(
                replace(trigger, idempotency_key=None)
            )
        assert await quotas.used(tenant_id, day) == 0
        assert await api.count_runs(caller) == 1


async def test_a_bulk_submission_that_loses_a_key_race_answers_with_the_winners_run(
    make_api: MakeApi,
) -> None:
    # Decided together, the keyed triggers find no run under their keys; "another process"
    # then stores one under the first key before the batch's transaction. The batch is
    # retried run by run: the loser answers with the winner's run and takes no unit.
    async with make_api() as api:
        caller = await api.tenant("sandbox")
        tenant_id = TenantId(caller.tenant_id)
        quotas = DatabaseQuotaStore(api.db, taken_with_runs=True)
        trigger, racing = await lost_race(api, tenant_id, "race-1")
        try:
            admission = await admission_over(api.db, racing, quotas)
            lost, other, conflict = await admission.admit_many(
                [
                    trigger,
                    replace(trigger, idempotency_key="race-2"),
                    replace(trigger, idempotency_key="race-3", input={"message": "other"}),
                ]
            )
        finally:
            await racing.close()
        assert isinstance(lost, Admitted) and not lost.created
        assert lost.run.idempotency_key == "race-1" and lost.run.input == {"message": "hi"}
        assert isinstance(other, Admitted) and other.created
        assert isinstance(conflict, Admitted) and conflict.created
        assert await quotas.used(tenant_id, quota_day(other.run.created_at)) == 2
        assert await api.count_runs(caller) == 3


async def test_a_batch_of_keyed_items_answers_repeats_from_one_read(
    make_api: MakeApi, deployment: Deployment
) -> None:
    # Keys of their own in the batch are decided together: the earlier runs are the answers of
    # repeats (200, or 409 for another input), which take no unit; new keys get new runs.
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("sandbox")  # daily quota 50
        for key in ("a", "b"):
            assert (
                await api.trigger(caller, input={"message": key}, idempotency_key=key)
            ).status_code == 202
        items = [
            {"input": {"message": "a"}, "idempotency_key": "a"},
            {"input": {"message": "changed"}, "idempotency_key": "b"},
            *({"input": {"message": f"n{n}"}, "idempotency_key": f"n{n}"} for n in range(300)),
        ]
        response = await api.client.post(
            "/v1/workflows/echo/runs/batch", json={"runs": items}, headers=caller.headers
        )
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert results[0]["status_code"] == 200
        assert results[1]["status_code"] == 409
        assert results[1]["error"]["code"] == "idempotency_conflict"
        codes = Counter(
            "accepted" if item["status_code"] == 202 else item["error"]["code"]
            for item in results[2:]
        )
        # The two earlier triggers took 2 units: 48 left for the new keys, in the list's order.
        assert codes == {"accepted": 48, "quota_exceeded": 252}
        assert all(item["status_code"] == 202 for item in results[2:50])
        again = await api.client.post(
            "/v1/workflows/echo/runs/batch", json={"runs": items[2:52]}, headers=caller.headers
        )
        answers = again.json()["results"]
        assert [item["status_code"] for item in answers[:48]] == [200] * 48
        assert [item["run_id"] for item in answers[:48]] == [r["run_id"] for r in results[2:50]]
        # A refused key was stored without it: it may be used again (and the quota refuses).
        assert {item["error"]["code"] for item in answers[48:]} == {"quota_exceeded"}
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert usage["used_today"] == 50
        assert await api.count_runs(caller, RunStatus.QUEUED) == 50
        assert await deployment.immortal_keys() == []


async def test_usage_and_queues_tell_the_truth(api: Api) -> None:
    caller = await api.tenant("sandbox")

    async def sandbox_queued() -> int:
        lanes = (await api.client.get("/v1/admin/queues", headers=ADMIN)).json()["lanes"]
        [lane] = [lane for lane in lanes if lane["lane"] == "workflow_sandbox"]
        queued: int = lane["queued"]
        return queued

    queued_before = await sandbox_queued()
    before = (await api.client.get("/v1/usage", headers=caller.headers)).json()
    assert before == {
        "tenant_id": caller.tenant_id,
        "tenant_name": before["tenant_name"],
        "plan": "sandbox",
        "daily_quota": QUOTA,
        "used_today": 0,
        "remaining": QUOTA,
        "resets_at": before["resets_at"],
        # No model was called: today's LLM usage is all zeros.
        "tokens_today": 0,
        "cost_today": 0.0,
        "saved_tokens_today": 0,
        "saved_cost_today": 0.0,
        "by_model": {},
        "by_workflow": {},
    }
    assert before["tenant_name"].startswith("tenant-")  # Api.tenant's names
    for expected in range(1, 4):
        assert (await api.trigger(caller)).status_code == 202
        now = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert (now["used_today"], now["remaining"]) == (expected, QUOTA - expected)
    assert await sandbox_queued() == queued_before + 3


async def test_the_admins_tenants_view_counts_as_usage_does(
    make_api: MakeApi, deployment: Deployment
) -> None:
    """One read of every tenant's counter (SQL ``IN`` or a Redis pipeline) per page."""
    async with make_api(**deployment.settings) as api:
        callers = [await api.tenant("sandbox") for _ in range(3)]
        for n, caller in enumerate(callers):
            for i in range(n * 2):
                assert (await api.trigger(caller, input={"message": str(i)})).status_code == 202
        page = await api.client.get("/v1/admin/tenants", params={"limit": 200}, headers=ADMIN)
        listed = {t["tenant_id"]: t for t in page.json()["tenants"]}
        for n, caller in enumerate(callers):
            usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
            assert listed[caller.tenant_id]["used_today"] == usage["used_today"] == n * 2
            assert listed[caller.tenant_id]["daily_quota"] == usage["daily_quota"] == QUOTA


async def test_the_redis_window_is_the_limits_librarys(deployment: Deployment) -> None:
    # One script counts a hit and reads the window; the window is the library's own, under its
    # key, so the library's calls (a process of an older version) see the same hits.
    if deployment.redis is None:
        pytest.skip("the window is in this process's memory")
    import limits
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter
    from redis.asyncio import ConnectionPool

    limiter = RateLimiter(Settings(**deployment.settings))
    # Any: the library types its connection options as float | str | bool.
    pool: Any = ConnectionPool.from_url(REDIS_TEST_URL)
    library = RedisStorage(
        f"async+{REDIS_TEST_URL}",
        implementation="redispy",
        key_prefix=f"{deployment.prefix}:ratelimit",
        connection_pool=pool,
    )
    strategy = MovingWindowRateLimiter(library)
    item = limits.parse("3/minute")
    try:
        first = await limiter.hit("key:a", "3/minute")
        assert first is not None and (first.limit, first.remaining) == (3, 2)
        assert 59 <= first.reset_s <= 60
        assert await strategy.hit(item, "key:a")  # the library counts in the same window
        assert (await strategy.get_window_stats(item, "key:a")).remaining == 1
        third = await limiter.hit("key:a", "3/minute")
        assert third is not None and third.remaining == 0
        with pytest.raises(RateLimited) as refused:
            await limiter.hit("key:a", "3/minute")
        assert (refused.value.limit, 1 <= refused.value.reset_s <= 60) == (3, True)
        assert not await strategy.hit(item, "key:a")
        other = await limiter.hit("key:b", "3/minute")
        assert other is not None and other.remaining == 2
    finally:
        await limiter.close()
        await pool.aclose()


async def test_rate_limit_hits_are_counted_before_quota_units(
    make_api: MakeApi, deployment: Deployment
) -> None:
    # With Redis the hits and the units of concurrent triggers are settled by their batch (the
    # Submitter's gate); without, trigger by trigger. Either way a trigger refused by the rate
    # limit takes no unit, and the answers carry the window.
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("trickle")  # daily quota 2, rate 3/minute
        answers = await asyncio.gather(
            *(api.trigger(caller, input={"message": str(i)}) for i in range(6))
        )
        codes = Counter(
            "accepted" if answer.status_code == 202 else answer.json()["error"]["code"]
            for answer in answers
        )
        assert codes == {"accepted": 2, "quota_exceeded": 1, "rate_limited": 3}
        windows = [
            (answer.headers["RateLimit-Limit"], answer.headers["RateLimit-Remaining"])
            for answer in answers
            if answer.status_code == 202 or answer.json()["error"]["code"] == "rate_limited"
        ]
        # Two of the three hits the window took (2, 1 or 0 left after each), then three refused.
        assert len(windows) == 5 and {limit for limit, _ in windows} == {"3"}
        assert sorted(remaining for _, remaining in windows)[:3] == ["0", "0", "0"]
        assert len({remaining for _, remaining in windows}) >= 2
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert (usage["used_today"], usage["remaining"]) == (2, 0)
        assert await api.count_runs(caller, RunStatus.QUEUED) == 2
        assert await api.count_runs(caller, RunStatus.RATE_LIMITED) == 1
        assert await deployment.immortal_keys() == []


async def test_a_trigger_refused_by_the_rate_limit_keeps_no_unit(
    make_api: MakeApi, deployment: Deployment
) -> None:
    # With Redis the gate takes a unit for every trigger of its batch in the round trip that
    # counts their hits, and gives back those of the hits it refused: none may stay taken.
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("burst")  # 3/minute, daily quota 100
        answers = await asyncio.gather(
            *(api.trigger(caller, input={"message": str(i)}) for i in range(8))
        )
        codes = Counter(
            "accepted" if answer.status_code == 202 else answer.json()["error"]["code"]
            for answer in answers
        )
        assert codes == {"accepted": 3, "rate_limited": 5}
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert (usage["used_today"], usage["remaining"]) == (3, 97)
        assert await api.count_runs(caller) == 3
        assert await deployment.immortal_keys() == []


async def test_a_batchs_items_are_counted_as_its_triggers_alone_would_be(
    make_api: MakeApi, deployment: Deployment
) -> None:
    # The items without lookups are decided together (the rate limit counted in one call or by
    # the gate, the units taken in the order given), those with a key on their own.
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("trickle")  # daily quota 2, rate 3/minute
        items: list[dict[str, Any]] = [
            {"input": {"message": "a"}},
            {"input": {"message": "b"}},
            {"input": {"message": "c"}},
            {"input": {"message": "d"}},
        ]
        response = await api.client.post(
            "/v1/workflows/echo/runs/batch", json={"runs": items}, headers=caller.headers
        )
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        codes = [
            "accepted" if item["status_code"] == 202 else item["error"]["code"] for item in results
        ]
        assert codes == ["accepted", "accepted", "quota_exceeded", "rate_limited"]
        assert results[2]["status"] == "rate_limited" and results[3]["run_id"] is None
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert (usage["used_today"], usage["remaining"]) == (2, 0)
        assert await api.count_runs(caller, RunStatus.QUEUED) == 2
        assert await api.count_runs(caller, RunStatus.RATE_LIMITED) == 1

        burst = await api.tenant("burst")  # 3/minute, daily quota 100
        items = [
            {"input": {"unknown": 1}},
            {"input": {"message": "k"}, "idempotency_key": "k-1"},
            {"input": {"message": "e"}},
            {"input": {"message": "f"}},
        ]
        response = await api.client.post(
            "/v1/workflows/echo/runs/batch", json={"runs": items}, headers=burst.headers
        )
        results = response.json()["results"]
        # Three hits fit the window. The invalid item's counts (422, nothing stored); of the
        # other three, whichever is counted last is refused (the keyed item is decided on its
        # own, concurrently with the plain ones).
        codes = sorted(
            "accepted" if item["status_code"] == 202 else item["error"]["code"] for item in results
        )
        assert codes == ["accepted", "accepted", "invalid_input", "rate_limited"]
        assert results[0]["error"]["code"] == "invalid_input"
        assert await api.count_runs(burst) == 2
        usage = (await api.client.get("/v1/usage", headers=burst.headers)).json()
        assert usage["used_today"] == 2
        assert await deployment.immortal_keys() == []


class FailingRuns(RunsRepo):
    """A repository whose batches never reach the database."""

    async def submit_many(
        self,
        new: Sequence[NewRun],
        *,
        quotas: Sequence[QuotaClaim | None] | None = None,
        announcement: Announcement | None = None,
    ) -> list[Run]:
        raise ConnectionResetError("the database went away")


async def test_units_the_gate_took_for_runs_not_stored_are_given_back(
    make_api: MakeApi, deployment: Deployment
) -> None:
    if deployment.redis is None:
        pytest.skip("counters in the database are taken in the batch's transaction, no gate")
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("sandbox")
        tenant_id = TenantId(caller.tenant_id)
        plan = await PlansProvider(api.settings).get("sandbox")
        quotas = RedisQuotaStore(deployment.url, prefix=deployment.prefix)
        limiter = RateLimiter(api.settings)
        gate = RedisGate(limiter, quotas)
        rival = NewRun(
            tenant_id=tenant_id,
            workflow="echo",
            input={"message": "hi"},
            lane=plan.lane,
            idempotency_key="race",
        )
        trigger = Trigger(
            tenant_id=tenant_id,
            plan=plan,
            rate_identity="test",
            workflow=workflows.app.get("echo"),
            input={"message": "hi"},
            idempotency_key="race",
        )
        racing = Submitter(RacingRuns(api.db, rival), gate=gate)
        failing = Submitter(FailingRuns(api.db), gate=gate)
        try:
            # The key's run is stored by "another process" after the lookup: the batch's unit
            # goes back and the answer is the other run.
            admitted = await (await admission_over(api.db, racing, quotas, limiter)).admit(trigger)
            assert not admitted.created and admitted.run.idempotency_key == "race"
            day = quota_day(admitted.run.created_at)
            assert await quotas.used(tenant_id, day) == 0
            # A trigger whose hit and unit the gate settles, in a batch that is never stored.
            with pytest.raises(ConnectionResetError):
                await (await admission_over(api.db, failing, quotas, limiter)).admit(
                    replace(trigger, idempotency_key=None)
                )
            assert await quotas.used(tenant_id, day) == 0
        finally:
            await racing.close()
            await failing.close()
            await limiter.close()
            await quotas.close()
        assert await api.count_runs(caller) == 1
        assert await deployment.immortal_keys() == []


async def test_the_gate_loads_the_scripts_redis_forgot(
    make_api: MakeApi, deployment: Deployment
) -> None:
    # SCRIPT FLUSH stands for a restarted or failed-over Redis: the pipelined EVALSHAs answer
    # NOSCRIPT, and the scripts are loaded and run again.
    if deployment.redis is None:
        pytest.skip("no Redis")
    async with make_api(**deployment.settings) as api:
        caller = await api.tenant("sandbox")
        assert (await api.trigger(caller, input={"message": "before"})).status_code == 202
        await deployment.redis.script_flush()
        answers = await asyncio.gather(
            *(api.trigger(caller, input={"message": str(i)}) for i in range(5))
        )
        assert [answer.status_code for answer in answers] == [202] * 5
        usage = (await api.client.get("/v1/usage", headers=caller.headers)).json()
        assert usage["used_today"] == 6


async def test_hits_of_one_credential_in_one_call_count_one_by_one(
    deployment: Deployment,
) -> None:
    # A batch's hits of one API key go to Redis as one script call; each still sees the window
    # it would have seen alone, and those past the limit are refused.
    limiter = RateLimiter(Settings(**deployment.settings))
    try:
        states = await limiter.hit_many([("key:a", "3/minute")] * 2 + [("key:b", "3/minute")])
        states += await limiter.hit_many([("key:a", "3/minute")] * 3)
    finally:
        await limiter.close()
    remaining = [
        "refused" if isinstance(state, RateLimited) else state and state.remaining
        for state in states
    ]
    assert remaining == [2, 1, 2, 0, "refused", "refused"]
