"""Property: random trees of child runs, with crashes and cancels, end cleanly (issue 17).

Hypothesis draws trees (depth <= 3, width <= 20, a bounded number of nodes) of one workflow,
``node``: it starts one child per subtree, gathers them (``return_exceptions=True``) and returns
the size of its finished subtree. At a drawn point of a node (before starting child ``i``,
before the gather, before returning) the node may, once per example:

- *crash*: its lease is expired and the real reaper takes the run back, so the attempt in
  flight is a zombie whose next fenced write (a child's start, the park, its end) fails,
  exactly as a worker that died or paused past its lease; the next claim replays it;
- *cancel*: ``cancel_run`` of the node itself (the API's path), which cascades to its
  descendants.

Everything runs in-process through the real Worker, runner, repositories and RuntimeStore, with
the real timer sweep (the children's backstop: wakes, orphans). Checked afterwards:

- every run of the tree ended, with exactly one terminal event;
- a run is ``cancelled`` only if it or an ancestor was cancelled, else it ``succeeded``;
- a succeeded parent has exactly one child per key and ended after every child;
- a succeeded run with no cancel in its subtree returns its subtree's size;
- every child's parent record exists (no orphan row).

The embedded database runs with the in-memory store, server databases with Redis. CI runs
``CI_EXAMPLES`` small trees per backend; ``MOORLINE_FULL=1`` more and larger ones.
"""

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from moorline import Context
from moorline.db.manager import DatabaseManager
from moorline.db.repos.children import ChildrenRepo
from moorline.db.repos.parking import ParkingRepo
from moorline.db.repos.queue import QueueRepo
from moorline.db.schema import events, runs
from moorline.dispatch.cancel import cancel_run
from moorline.dispatch.leader import LeaderElector
from moorline.dispatch.reaper import Reaper
from moorline.dispatch.timers import TimerSweep
from moorline.errors import RunFinished
from moorline.runtime.base import RuntimeStore
from moorline.types import TERMINAL_STATUSES, JSONObject, JSONValue, RunStatus
from tests.contract.queue_helpers import Tenants, set_lease_expiry
from tests.engine.harness import EngineHarness
from tests.helpers import FULL_SIZE, wait_for

CI_EXAMPLES = 8
FULL_EXAMPLES = 60
EXAMPLES = FULL_EXAMPLES if FULL_SIZE else CI_EXAMPLES
MAX_DEPTH = 3
MAX_WIDTH = 20
MAX_NODES = 200 if FULL_SIZE else 40
SLOTS = 8
PARK_AFTER_S = 0.1
SWEEP_INTERVAL_S = 0.1
SETTLE_S = 120.0 if FULL_SIZE else 60.0
TERMINAL_EVENTS = [status.value for status in TERMINAL_STATUSES]


@dataclass(frozen=True)
class Node:
    """One run of the tree; ``crash``/``cancel`` are points 0..width+1 (see the docstring)."""

    kids: tuple["Node", ...] = ()
    crash: int | None = None
    cancel: int | None = None

    def spec(self, path: str) -> JSONObject:
        kids: list[JSONValue] = [kid.spec(f"{path}.{i}") for i, kid in enumerate(self.kids)]
        return {"id": path, "kids": kids, "crash": self.crash, "cancel": self.cancel}

    def size(self) -> int:
        return 1 + sum(kid.size() for kid in self.kids)


@st.composite
def trees(draw: st.DrawFn, depth: int = 0, budget: list[int] | None = None) -> Node:
    left = budget if budget is not None else [MAX_NODES - 1]
    widest = min(MAX_WIDTH, left[0]) if depth < MAX_DEPTH else 0
    width = draw(st.integers(0, widest))
    left[0] -= width
    kids = tuple(draw(trees(depth + 1, left)) for _ in range(width))
    point = st.integers(0, width + 1)
    crash = draw(st.one_of(st.none(), st.none(), st.none(), point))
    cancel = draw(st.one_of(*[st.none()] * 9, point))
    return Node(kids, crash, cancel)


@dataclass
class Faults:
    """What the nodes did to themselves; each fault fires once per node and example."""

    crashed: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)


@pytest.fixture
async def tenants(db: DatabaseManager) -> AsyncIterator[Tenants]:
    made = Tenants(db)
    yield made
    await made.purge()


def register(engine: EngineHarness, reaper: Reaper, children: ChildrenRepo, faults: Faults) -> None:
    @engine.app.workflow("node", max_attempts=10)
    async def node(ctx: Context, spec: dict[str, Any]) -> int:
        node_id = str(spec["id"])
        kids = spec["kids"]
        assert isinstance(kids, list)

        async def at(point: int) -> None:
            if spec["crash"] == point and node_id not in faults.crashed:
                faults.crashed.add(node_id)
                await take_back(engine, reaper, ctx.run_id, ctx.attempt)
            if spec["cancel"] == point and node_id not in faults.cancelled:
                faults.cancelled.add(node_id)
                assert engine.tenant is not None
                try:
                    await cancel_run(engine.runs, engine.store, engine.tenant, ctx.run_id, children)
                except RunFinished:
                    pass  # a crash just now, and a cancel of an ancestor, ended it

        handles = []
        for index, kid in enumerate(kids):
            await at(index)
            assert isinstance(kid, dict)
            handles.append(await ctx.start_child("node", {"spec": kid}, key=f"k:{index}"))
        await at(len(kids))
        outcomes = await ctx.gather(*handles, return_exceptions=True)
        await at(len(kids) + 1)
        return 1 + sum(o for o in outcomes if isinstance(o, int))


async def take_back(engine: EngineHarness, reaper: Reaper, run_id: str, attempt: int) -> None:
    """Expire the lease and let the reaper take the run back: the attempt becomes a zombie.

    The reaper skips a row another transaction holds locked (a child ending locks its parent
    to wake it), so a pass can miss the run; the crash repeats until a pass took it.
    """

    async def taken() -> bool:
        await set_lease_expiry(engine.db, [run_id], -1.0)
        await reaper.tick()
        async with engine.db.connect() as conn:
            row = (
                await conn.execute(select(runs.c.status, runs.c.attempt).where(runs.c.id == run_id))
            ).one()
        return bool(row.status != RunStatus.RUNNING.value or row.attempt != attempt)

    await wait_for(taken, timeout_s=10.0, interval_s=0.01, message="the reaper took it back")


@asynccontextmanager
async def sweeping(engine: EngineHarness, children: ChildrenRepo) -> AsyncIterator[None]:
    """The timer sweep (the children's backstop) as a live process runs it."""
    name = f"timers-{uuid.uuid4().hex[:8]}"
    sweep = TimerSweep(
        ParkingRepo(engine.db),
        LeaderElector(engine.queue, name=name, holder=name, ttl_s=30),
        interval_s=SWEEP_INTERVAL_S,
        children=children,
        runs=engine.runs,
    )
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            await sweep.tick()
            try:
                async with asyncio.timeout(SWEEP_INTERVAL_S):
                    await stop.wait()
            except TimeoutError:
                pass

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        await task


def walk(node: Node, path: str = "0") -> Iterator[tuple[str, Node]]:
    yield path, node
    for index, kid in enumerate(node.kids):
        yield from walk(kid, f"{path}.{index}")


def has_cancel(node: Node) -> bool:
    return node.cancel is not None or any(has_cancel(kid) for kid in node.kids)


async def check_tree(engine: EngineHarness, root_id: str, tree: Node, faults: Faults) -> None:
    assert engine.tenant is not None
    async with engine.db.connect() as conn:
        rows = {
            row.id: row
            for row in await conn.execute(select(runs).where(runs.c.tenant_id == engine.tenant))
        }
        ended = Counter(
            (
                await conn.execute(
                    select(events.c.run_id).where(
                        events.c.run_id.in_(list(rows)), events.c.type.in_(TERMINAL_EVENTS)
                    )
                )
            ).scalars()
        )
    assert ended == Counter({run_id: 1 for run_id in rows}), "a run ended twice or never"
    # No child without its parent's record; one child per (parent, key).
    keys = Counter((row.parent_run_id, row.child_key) for row in rows.values())
    assert all(n == 1 for (parent, _), n in keys.items() if parent is not None), keys
    orphans = [r.id for r in rows.values() if r.parent_run_id and r.parent_run_id not in rows]
    assert not orphans, f"children without a parent record: {orphans}"
    # Map tree paths to run ids by following (parent, key).
    by_key = {(row.parent_run_id, row.child_key): row for row in rows.values()}
    ids: dict[str, str] = {"0": root_id}
    cancelled_above: dict[str, bool] = {"0": False}
    for path, node in walk(tree):
        run_id = ids.get(path)
        if run_id is None:
            # Never started: only an ancestor's cancel (or its own subtree's) stops a start.
            assert cancelled_above[path], f"node {path} was never started"
            for index in range(len(node.kids)):
                cancelled_above[f"{path}.{index}"] = True
            continue
        row = rows[run_id]
        if path in faults.crashed and row.status == RunStatus.SUCCEEDED.value:
            assert row.attempt >= 2, f"the crash of {path} took nothing back"
        marked = cancelled_above[path] or node.cancel is not None
        if not marked:
            assert row.status == RunStatus.SUCCEEDED.value, (path, row.status, row.error)
        else:
            assert row.status in {"succeeded", "cancelled"}, (path, row.status, row.error)
        for index, _ in enumerate(node.kids):
            kid = by_key.get((run_id, f"k:{index}"))
            kid_path = f"{path}.{index}"
            cancelled_above[kid_path] = marked
            if kid is not None:
                ids[kid_path] = kid.id
        if row.status == RunStatus.SUCCEEDED.value:
            kids = [by_key[(run_id, f"k:{i}")] for i in range(len(node.kids))]
            assert len(kids) == sum(1 for r in rows.values() if r.parent_run_id == run_id)
            late = [k.id for k in kids if k.finished_at > row.finished_at]
            assert not late, f"run {path} ended before its children {late}"
            if not has_cancel(node) and not cancelled_above[path]:
                assert row.output == node.size(), (path, row.output, node.size())


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(tree=trees())
@example(tree=Node(tuple(Node() for _ in range(3)), crash=3))
@example(tree=Node((Node((Node(), Node()), cancel=2), Node(crash=1)), crash=1))
@example(tree=Node((Node((Node((Node(),)),)), Node()), cancel=2))
async def test_random_trees_with_crashes_and_cancels_end_cleanly(
    db: DatabaseManager, store: RuntimeStore, tenants: Tenants, tree: Node
) -> None:
    engine = EngineHarness(db, store, tenants, park_after_s=PARK_AFTER_S)
    name = f"reaper-{uuid.uuid4().hex[:8]}"
    reaper = Reaper(
        engine.queue,
        LeaderElector(QueueRepo(db), name=name, holder=name, ttl_s=30),
        interval_s=1.0,
    )
    children = ChildrenRepo(db)
    faults = Faults()
    register(engine, reaper, children, faults)
    root = await engine.new_run("node", input={"spec": tree.spec("0")})
    assert engine.tenant is not None
    tenant = engine.tenant

    async def all_ended() -> bool:
        async with db.connect() as conn:
            states = (
                await conn.execute(select(runs.c.status).where(runs.c.tenant_id == tenant))
            ).scalars()
            return all(RunStatus(s).is_terminal for s in states)

    async with sweeping(engine, children), engine.worker(slots=SLOTS):
        await wait_for(all_ended, timeout_s=SETTLE_S, interval_s=0.05, message="every run")
    await check_tree(engine, root, tree, faults)
