"""Child runs through a real Worker: fan-out and join, the parent parked while it waits.

Children are runs of their own in the parent's lane; the parent parks after ``park_after``
and its worker slot serves the children; the last child's end re-queues it, and its replay
gets the same children (one per key) and their outputs.
"""

from collections.abc import AsyncIterator

import pytest

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.engine import children as children_module
from moorline.errors import ChildFailed
from moorline.runtime.base import RuntimeStore
from moorline.types import JSONValue, RunStatus
from tests.contract.queue_helpers import Tenants
from tests.engine.harness import EngineHarness

PARK_AFTER_S = 0.1


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


@pytest.fixture
def engine(db: DatabaseManager, store: RuntimeStore, tenants: Tenants) -> EngineHarness:
    return EngineHarness(db, store, tenants, park_after_s=PARK_AFTER_S)


def register(engine: EngineHarness, calls: list[int]) -> None:
    @engine.app.workflow("double")
    async def double(ctx: Context, n: int) -> int:
        calls.append(n)
        if n < 0:
            raise ValueError(f"no negative numbers: {n}")
        return 2 * n

    @engine.app.workflow("fan_out")
    async def fan_out(ctx: Context, numbers: list[int]) -> JSONValue:
        results = await ctx.map("double", [{"n": n} for n in numbers], key="n")
        return {"sum": sum(r for r in results if isinstance(r, int)), "results": results}

    @engine.app.workflow("tolerant")
    async def tolerant(ctx: Context, numbers: list[int]) -> JSONValue:
        handles = [
            await ctx.start_child("double", {"n": n}, key=f"n:{i}") for i, n in enumerate(numbers)
        ]
        outcomes = await ctx.gather(*handles, return_exceptions=True)
        shown: list[JSONValue] = [
            o.child_status if isinstance(o, ChildFailed) else o for o in outcomes
        ]
        return shown


async def test_a_parent_fans_out_parks_with_one_slot_and_joins_every_child_once(
    engine: EngineHarness,
) -> None:
    calls: list[int] = []
    register(engine, calls)
    parent = await engine.new_run("fan_out", input={"numbers": [1, 2, 3]})
    # One slot: the children can only run because the waiting parent gave it back.
    async with engine.worker(slots=1):
        await engine.until_status(parent, RunStatus.SUCCEEDED)
    run = await engine.runs.get(parent)
    assert run is not None and run.output == {"sum": 12, "results": [2, 4, 6]}
    children = await ChildrenRepo(engine.db).list(parent)
    assert sorted(c.child_key or "" for c in children) == ["n:0", "n:1", "n:2"]
    assert all(c.status is RunStatus.SUCCEEDED and c.depth == 1 for c in children)
    assert sorted(calls) == [1, 2, 3]  # each child ran once
    types = [e.type for e in await engine.stored(parent)]
    assert types.count("child_started") == 3 and "waiting" in types and "resumed" in types


async def test_a_failed_child_is_reported_to_the_parent(engine: EngineHarness) -> None:
    calls: list[int] = []
    register(engine, calls)
    parent = await engine.new_run("tolerant", input={"numbers": [5, -1]})
    async with engine.worker(slots=2):
        await engine.until_status(parent, RunStatus.SUCCEEDED, timeout_s=30)
    run = await engine.runs.get(parent)
    assert run is not None and run.output == [10, "failed"]


async def test_cancelling_a_parent_cancels_its_unfinished_children(
    engine: EngineHarness,
) -> None:
    @engine.app.workflow("forever")
    async def forever(ctx: Context) -> None:
        await ctx.wait_for_message()

    @engine.app.workflow("parent")
    async def parent_workflow(ctx: Context) -> int:
        return len(await ctx.map("forever", [{}, {}], key="f"))

    from moorline.dispatch.cancel import cancel_run

    parent = await engine.new_run("parent")
    repo = ChildrenRepo(engine.db)
    async with engine.worker(slots=4):
        await engine.until_status(parent, RunStatus.WAITING)

        async def two_children_waiting() -> bool:
            children = await repo.list(parent)
            return len(children) == 2 and all(c.status is RunStatus.WAITING for c in children)

        from tests.helpers import wait_for

        await wait_for(two_children_waiting, message="both children to wait")
        assert engine.tenant is not None
        await cancel_run(engine.runs, engine.store, engine.tenant, parent, repo)
    statuses = {c.status for c in await repo.list(parent)}
    assert statuses == {RunStatus.CANCELLED}
    assert await engine.status(parent) is RunStatus.CANCELLED


async def test_a_join_in_memory_is_woken_by_its_children_ending_in_this_process(
    db: DatabaseManager,
    store: RuntimeStore,
    tenants: Tenants,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The join's poll is 30 s here and the parent never parks: only the worker telling the
    # runner that the children ended can bring the parent back within the test's 20 s.
    monkeypatch.setattr(children_module, "JOIN_POLL_S", 30.0)
    patient = EngineHarness(db, store, tenants, park_after_s=600.0)
    calls: list[int] = []
    register(patient, calls)
    parent = await patient.new_run("fan_out", input={"numbers": [1, 2, 3]})
    async with patient.worker(slots=4):
        await patient.until_status(parent, RunStatus.SUCCEEDED)
    run = await patient.runs.get(parent)
    assert run is not None and run.output == {"sum": 12, "results": [2, 4, 6]}
    assert "waiting" not in [e.type for e in await patient.stored(parent)]  # never parked
