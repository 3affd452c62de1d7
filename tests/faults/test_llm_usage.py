"""LLM usage end to end: worker processes, the test OpenAI server, the HTTP API (issue 18).

Runs of the bundled examples (``doc_check``: each section a child run asking the model once)
are triggered through the API and executed by real ``moorline worker`` processes whose model
is the OpenAI-compatible test server, reached with the production client. Afterwards Moorline's
accounting (per run, per tenant today, per model, and ``/metrics``) must equal what the server
itself counts having served, token for token.

Then kill -9: a worker dies in the middle of runs of several model calls each; the runs finish
on another worker, which replays the calls that were checkpointed. Those calls' tokens must
show as saved (once per replay) and never as spent twice: every step's usage is counted once,
and the runs', the tenant's and the model's totals are the sums of the steps'.

PostgreSQL only: the roll-up's SQL runs on every backend in tests/contract/test_usage_repo.py.
"""

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from moorline.client import Run, Usage
from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import RunsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.db.repos.usage import UsageRepo
from moorline.db.schema import events, runs
from moorline.examples.app import app as examples
from moorline.settings import Settings
from moorline.types import TERMINAL_STATUSES, RunId, RunStatus, TenantId
from tests.contract.queue_helpers import Tenants
from tests.examples.openai_server import Answer, OpenAIServer
from tests.faults.harness import PLAN, Workers, in_process_api, new_tenant, plans_file, submit
from tests.helpers import FULL_SIZE, wait_for

pytestmark = pytest.mark.faults

MODEL = "usage-model"
RUNS = 200 if FULL_SIZE else 40
"""doc_check runs of the accounting test (each has 2 or 3 sections: a child run each)."""
CHAIN_RUNS = 30 if FULL_SIZE else 12
CHAIN_STEPS = 6
ACCOUNTING_LEASE_TTL_S = 30.0
KILL_LEASE_TTL_S = 8.0
"""The kill test's lease: the killed worker's runs come back this long after the kill."""
ADMIN_TOKEN = "usage-admin-token"
MODELS_YAML = f"""
models:
  {MODEL}:
    input_per_million: 2.0
    output_per_million: 8.0
    cached_input_per_million: 1.0
"""
TERMINAL = [status.value for status in TERMINAL_STATUSES]


@pytest.fixture(scope="module")
def backend() -> str:
    return "postgresql"


@pytest.fixture
async def server() -> AsyncIterator[OpenAIServer]:
    async with OpenAIServer(Answer(chunks=["VERDICT: ", "PASS\n", "all ", "good"])) as made:
        yield made


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(MODELS_YAML, encoding="utf-8")
    return path


@pytest.fixture
def workers(
    database_url: str, tmp_path: Path, server: OpenAIServer, models_file: Path
) -> Iterator[Workers]:
    made = Workers(
        database_url,
        tmp_path,
        app="tests.faults.llm_usage_app:app",
        measured=False,
        extra_env={
            "MOORLINE_LLM_BASE_URL": server.base_url,
            "MOORLINE_LLM_MODEL": MODEL,
            "MOORLINE_MODELS_FILE": str(models_file),
            # Long enough that a loaded machine never self-fences a worker: an attempt that
            # loses its lease has its checkpoint refused, and the call it paid for with it.
            "MOORLINE_LEASE_TTL": str(ACCOUNTING_LEASE_TTL_S),
        },
    )
    yield made
    made.kill_all()


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
async def api(
    database_url: str, tmp_path: Path, models_file: Path, db: DatabaseManager
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        database_url=database_url,
        edition="community",
        plans_file=plans_file(tmp_path, tenant_concurrency=1000),
        admin_token=ADMIN_TOKEN,
        models_file=models_file,
        # The test reads every run back in a tight loop: more than the default 100 a second.
        request_rate_limit="10000/second",
    )
    async with in_process_api(settings, examples) as client:
        yield client


def document(index: int) -> str:
    sections = 2 + index % 2
    return "\n".join(
        f"# Part {n} of doc {index}\nText {'x' * (index + n)}.\n" for n in range(sections)
    )


async def all_ended(db: DatabaseManager, tenant_id: str, expected: int) -> bool:
    async with db.connect() as conn:
        ended = (
            await conn.execute(
                select(func.count()).where(
                    runs.c.tenant_id == tenant_id, runs.c.status.in_(TERMINAL)
                )
            )
        ).scalar_one()
    return int(ended) >= expected


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name{labels}`` in a Prometheus exposition."""
    for line in text.splitlines():
        match = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if all(found.get(key) == value for key, value in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"no sample {name}{labels}")


async def test_usage_equals_what_the_server_served(
    api: httpx.AsyncClient, db: DatabaseManager, workers: Workers, server: OpenAIServer
) -> None:
    tenant_id, headers = await new_tenant(api, ADMIN_TOKEN, "usage")
    run_ids = []
    for index in range(RUNS):
        response = await api.post(
            "/v1/workflows/doc_check/runs",
            json={"input": {"document": document(index)}},
            headers=headers,
        )
        assert response.status_code == 202, response.text
        run_ids.append(response.json()["run_id"])
    sections = sum(2 + index % 2 for index in range(RUNS))
    for _ in range(2):
        workers.start()

    async def ended() -> bool:
        return await all_ended(db, tenant_id, RUNS + sections)

    await wait_for(ended, timeout_s=240, message="every doc_check run and section to end")
    workers.terminate_all()

    served = server.served[MODEL]
    assert served.requests >= sections and served.rejected == 0
    # A run counts its own steps' calls (a doc_check parent none, each section one).
    totals = {"prompt": 0, "completion": 0, "cached": 0, "requests": 0, "cost": 0.0}
    replayed = 0
    async with db.connect() as conn:
        rows = (
            await conn.execute(
                select(runs.c.id, runs.c.status).where(runs.c.tenant_id == tenant_id)
            )
        ).all()
        reclaimed = (
            await conn.execute(
                select(func.count())
                .select_from(events.join(runs, events.c.run_id == runs.c.id))
                .where(runs.c.tenant_id == tenant_id, events.c.type == "reclaimed")
            )
        ).scalar_one()
    assert {row.status for row in rows} == {RunStatus.SUCCEEDED.value}
    for row in rows:
        answer = await api.get(f"/v1/runs/{row.id}", headers=headers)
        assert answer.status_code == 200, answer.text
        detail = answer.json()
        usage = detail["usage"]
        parsed = Run.model_validate(detail)  # the Python client reads the same
        assert parsed.usage is not None and parsed.usage.prompt_tokens == usage["prompt_tokens"]
        by_model = usage["by_model"]
        step_sum = sum(
            step["usage"][MODEL]["prompt_tokens"] for step in detail["steps"] if step["usage"]
        )
        assert usage["prompt_tokens"] == step_sum
        if by_model:
            assert by_model[MODEL]["prompt_tokens"] == usage["prompt_tokens"]
            totals["requests"] += by_model[MODEL]["requests"]
        totals["prompt"] += usage["prompt_tokens"]
        totals["completion"] += usage["completion_tokens"]
        totals["cached"] += usage["cached_tokens"]
        totals["cost"] += usage["cost"]
        # No worker is killed here, yet on a loaded machine a lease may still expire and the
        # next attempt replay the step: the replay saved at most the step's tokens once per
        # later attempt.
        most = sum(
            (step["usage"][MODEL]["prompt_tokens"] + step["usage"][MODEL]["completion_tokens"])
            * (detail["attempt"] - step["attempt"])
            for step in detail["steps"]
            if step["usage"]
        )
        assert usage["saved_tokens"] <= most
        replayed += usage["saved_tokens"] > 0
    print(
        f"{len(rows)} runs, {served.requests} calls served, {totals['requests']} counted, "
        f"{reclaimed} attempts reclaimed, {replayed} runs replayed a counted call"
    )
    counted = (totals["prompt"], totals["completion"], totals["cached"], totals["requests"])
    provider = (
        served.prompt_tokens,
        served.completion_tokens,
        served.cached_tokens,
        served.requests,
    )
    if reclaimed == 0:
        assert counted == provider
    else:
        # An attempt whose lease expired has its checkpoint refused, and the usage of the
        # call it made with it (docs/reliability.md): at most one call per reclaimed attempt
        # is served and not counted.
        assert served.requests - reclaimed <= totals["requests"] <= served.requests
        assert all(mine <= theirs for mine, theirs in zip(counted, provider, strict=True))
    expected_cost = (
        (totals["prompt"] - totals["cached"]) * 2.0
        + totals["cached"] * 1.0
        + totals["completion"] * 8.0
    ) / 1e6
    assert totals["cost"] == pytest.approx(expected_cost)

    today = (await api.get("/v1/usage", headers=headers)).json()
    assert Usage.model_validate(today).by_model[MODEL].requests == totals["requests"]
    assert today["tokens_today"] == totals["prompt"] + totals["completion"]
    assert today["cost_today"] == pytest.approx(expected_cost)
    assert set(today["by_workflow"]) == {"doc_check_section"}
    assert today["by_workflow"]["doc_check_section"]["prompt_tokens"] == totals["prompt"]

    # /metrics serves the database's totals (every tenant's): they include this tenant's.
    exposition = (await api.get("/metrics")).text
    everyone = {model: row for _, model, row in await UsageRepo(db).totals()}
    for kind, value in (
        ("prompt", everyone[MODEL].totals.prompt_tokens),
        ("completion", everyone[MODEL].totals.completion_tokens),
        ("cached", everyone[MODEL].totals.cached_tokens),
    ):
        assert metric(exposition, "moorline_llm_tokens_total", model=MODEL, kind=kind) == value
    assert everyone[MODEL].totals.prompt_tokens >= totals["prompt"]
    ok = metric(exposition, "moorline_llm_requests_total", model=MODEL, outcome="ok")
    assert ok == everyone[MODEL].totals.requests >= totals["requests"]
    cost = metric(exposition, "moorline_llm_cost_total", model=MODEL)
    assert cost == pytest.approx(everyone[MODEL].totals.cost)


async def test_replayed_steps_count_as_saved_after_kill_9(
    db: DatabaseManager, tenants: Tenants, workers: Workers, server: OpenAIServer
) -> None:
    # Slow calls (about 0.3 s each), so a kill lands in the middle of a chain.
    server.default = Answer(chunks=["one ", "two ", "three ", "four"], pause_s=0.1)
    workers.extra_env["MOORLINE_LEASE_TTL"] = str(KILL_LEASE_TTL_S)
    tenant: TenantId = await tenants.new(PLAN)
    run_ids = await submit(
        RunsRepo(db), [tenant], "llm_chain", [{"steps": CHAIN_STEPS}] * CHAIN_RUNS
    )
    first = workers.start()
    steps_repo = StepsRepo(db)

    async def some_chains_half_done() -> bool:
        done = 0
        for run_id in run_ids:
            finished = [s for s in await steps_repo.list(run_id) if s.finished_at is not None]
            done += 2 <= len(finished) < CHAIN_STEPS
        return done >= 3

    await wait_for(some_chains_half_done, timeout_s=120, message="chains part-way through")
    first.kill()
    first.wait()
    workers.start()

    async def ended() -> bool:
        return await all_ended(db, tenant, CHAIN_RUNS)

    await wait_for(ended, timeout_s=180, message="every chain to end after the kill")
    workers.terminate_all()

    runs_repo = RunsRepo(db)
    saved_runs = 0
    recorded_requests = 0
    for run_id in run_ids:
        run = await runs_repo.get(RunId(run_id))
        assert run is not None and run.status is RunStatus.SUCCEEDED, run
        steps = await steps_repo.list(run_id)
        assert len(steps) == CHAIN_STEPS
        # Spent: each step once, whatever attempt ran it.
        assert run.prompt_tokens == sum(s.usage[MODEL].prompt_tokens for s in steps)
        assert run.completion_tokens == sum(s.usage[MODEL].completion_tokens for s in steps)
        recorded_requests += sum(s.usage[MODEL].requests for s in steps)
        # Saved: a step recorded under attempt a was replayed by each later attempt.
        expected_saved = sum(
            (s.usage[MODEL].prompt_tokens + s.usage[MODEL].completion_tokens)
            * (run.attempt - s.attempt)
            for s in steps
        )
        assert run.saved_tokens == expected_saved, (run_id, run.attempt)
        saved_runs += run.saved_tokens > 0
    assert saved_runs >= 3
    assert recorded_requests == CHAIN_RUNS * CHAIN_STEPS
    # The server served every recorded call, and at most the calls in flight at the kill
    # besides (answered, but their steps died before their checkpoints).
    served = server.served[MODEL]
    assert 0 <= served.requests - recorded_requests <= workers.slots
