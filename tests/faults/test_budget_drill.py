"""Issue 18's budget drill: one tenant's concurrent runs against its ``daily_tokens`` budget.

Three ``moorline worker`` processes on PostgreSQL share the budget in Redis and call the
OpenAI-compatible test server through the production client. One tenant's runs (50 at the
issue's size, ``MOORLINE_FULL=1``; 24 in CI), each a chain of model calls, all run at once
against a budget that covers about half of their calls. Checked:

- the tokens spent never exceed the budget by more than the calls in flight when it ran out:
  a call starts only while the day's spend is under the budget, and each run has at most one
  call in flight, so the overshoot is at most ``runs in flight * the largest call``;
- the spend is exactly what the server served (every call charged once, none lost);
- the runs that met the spent budget failed with reason ``budget``, not retried;
- a new trigger of that tenant is refused with 429 ``budget_exhausted`` and ``Retry-After``,
  and nothing is stored; another tenant on the same plan is unaffected;
- every key the budget left in Redis expires.
"""

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.db.schema import runs
from moorline.dispatch.budgets import RedisBudgetStore
from moorline.settings import Settings
from moorline.types import TERMINAL_STATUSES, RunStatus
from tests.examples.openai_server import Answer, OpenAIServer
from tests.faults.harness import Workers, in_process_api, new_tenant, plans_file
from tests.helpers import FULL_SIZE, wait_for
from tests.servers import REDIS_TEST_URL

pytestmark = pytest.mark.faults

MODEL = "budget-model"
RUNS = 50 if FULL_SIZE else 24
STEPS = 4
WORKERS = 3
SLOTS = 20
"""Per worker: 60 slots, so every run of the tenant is in flight at once."""
BUDGET_TOKENS = 11 * RUNS * STEPS // 2
"""About half the calls' tokens (a call is about 11: 9 of prompt, 2 of reply)."""
ADMIN_TOKEN = "budget-admin-token"
TERMINAL = [status.value for status in TERMINAL_STATUSES]


@pytest.fixture(scope="module")
def backend() -> str:
    return "postgresql"


@pytest.fixture
async def server() -> AsyncIterator[OpenAIServer]:
    # Slow replies (about 0.1 s), so that many calls are in flight when the budget runs out.
    async with OpenAIServer(Answer(chunks=["fine ", "thanks"], pause_s=0.05)) as made:
        yield made


@pytest.fixture
def workers(
    database_url: str, tmp_path: Path, server: OpenAIServer, redis_prefix: str
) -> Iterator[Workers]:
    made = Workers(
        database_url,
        tmp_path,
        slots=SLOTS,
        app="tests.faults.llm_usage_app:app",
        measured=False,
        daily_tokens=BUDGET_TOKENS,
        redis_url=REDIS_TEST_URL,
        redis_prefix=redis_prefix,
        extra_env={
            "MOORLINE_LLM_BASE_URL": server.base_url,
            "MOORLINE_LLM_MODEL": MODEL,
            # No lease expires on a loaded machine: every call is charged by its own attempt.
            "MOORLINE_LEASE_TTL": "30",
        },
    )
    yield made
    made.kill_all()


@pytest.fixture
async def api(
    database_url: str, tmp_path: Path, redis_prefix: str, db: DatabaseManager
) -> AsyncIterator[httpx.AsyncClient]:
    # ``db`` built the schema (in_process_api's app does not).
    settings = Settings(
        database_url=database_url,
        edition="community",
        plans_file=plans_file(tmp_path, tenant_concurrency=1000, daily_tokens=BUDGET_TOKENS),
        admin_token=ADMIN_TOKEN,
        redis_url=REDIS_TEST_URL,
        redis_prefix=redis_prefix,
    )
    from tests.faults.llm_usage_app import app as workflows

    async with in_process_api(settings, workflows) as client:
        yield client


async def trigger(api: httpx.AsyncClient, headers: dict[str, str]) -> httpx.Response:
    return await api.post(
        "/v1/workflows/llm_chain/runs",
        json={"input": {"steps": STEPS, "topic": "budget"}},
        headers=headers,
    )


async def count_runs(db: DatabaseManager, tenant_id: str, *, ended: bool) -> int:
    query = select(func.count()).where(runs.c.tenant_id == tenant_id)
    if ended:
        query = query.where(runs.c.status.in_(TERMINAL))
    async with db.connect() as conn:
        return int((await conn.execute(query)).scalar_one())


async def test_concurrent_runs_overshoot_the_budget_by_at_most_the_calls_in_flight(
    api: httpx.AsyncClient,
    db: DatabaseManager,
    workers: Workers,
    server: OpenAIServer,
    redis_prefix: str,
) -> None:
    spender, spender_headers = await new_tenant(api, ADMIN_TOKEN, "budget")
    _, other_headers = await new_tenant(api, ADMIN_TOKEN, "budget")
    for _ in range(RUNS):
        response = await trigger(api, spender_headers)
        assert response.status_code == 202, response.text
    for _ in range(WORKERS):
        workers.start()

    async def all_ended() -> bool:
        return await count_runs(db, spender, ended=True) == RUNS

    await wait_for(all_ended, timeout_s=240, message="every run of the spender to end")

    day = datetime.now(UTC).strftime("%Y-%m-%d")
    budgets = RedisBudgetStore(REDIS_TEST_URL, prefix=redis_prefix)
    try:
        spent = (await budgets.spent(spender, day)).tokens
    finally:
        await budgets.close()
    served = server.served[MODEL]
    # Every call served was charged, once: the spend is the provider's own count.
    assert spent == served.prompt_tokens + served.completion_tokens
    steps_repo, runs_repo = StepsRepo(db), RunsRepo(db)
    largest_call, failed = 0, 0
    async with db.connect() as conn:
        run_ids = (await conn.execute(select(runs.c.id).where(runs.c.tenant_id == spender))).all()
    for (run_id,) in run_ids:
        run = await runs_repo.get(run_id)
        assert run is not None and run.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
        if run.status is RunStatus.FAILED:
            failed += 1
            assert isinstance(run.error, dict) and run.error["reason"] == "budget", run.error
            assert run.attempt == 1  # BudgetExceeded is not retried
        for step in await steps_repo.list(run_id):
            for usage in (step.usage or {}).values():
                largest_call = max(largest_call, usage.prompt_tokens + usage.completion_tokens)
    in_flight = min(RUNS, WORKERS * SLOTS)
    bound = in_flight * largest_call
    print(
        f"budget {BUDGET_TOKENS}, spent {spent} (overshoot {spent - BUDGET_TOKENS}, bound "
        f"{bound} = {in_flight} runs in flight x {largest_call} tokens), "
        f"{served.requests} calls, {failed} of {RUNS} runs failed on the budget"
    )
    assert failed > 0  # the runs share the budget as they go: most or all meet its end
    assert BUDGET_TOKENS <= spent <= BUDGET_TOKENS + bound

    # The spent budget refuses the tenant's next trigger, storing nothing; the other runs on.
    refused = await trigger(api, spender_headers)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "budget_exhausted"
    assert 0 < int(refused.headers["Retry-After"]) <= 86_400
    assert await count_runs(db, spender, ended=False) == RUNS
    accepted = await trigger(api, other_headers)
    assert accepted.status_code == 202, accepted.text

    async def other_done() -> bool:
        run = await runs_repo.get(accepted.json()["run_id"])
        return run is not None and run.status is RunStatus.SUCCEEDED

    await wait_for(other_done, timeout_s=60, message="the other tenant's run to succeed")
    workers.terminate_all()
    # redis_prefix's teardown checks that every key the budget left expires.
