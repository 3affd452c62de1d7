"""Leader election on every backend: one holder at a time, takeover, resignation, the cache."""

import asyncio
import time

from sqlalchemy import select, update

from moorline.db.manager import DatabaseManager
from moorline.db.repos.queue import QueueRepo
from moorline.db.schema import leader_leases
from moorline.dispatch.leader import VERIFY_EVERY_TICKS, LeaderElector, new_holder_id
from tests.contract.queue_helpers import unique
from tests.helpers import wait_for

CANDIDATES = 8
ROUNDS = 10


class FakeClock:
    """A monotonic clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def elector(
    queue: QueueRepo,
    name: str,
    holder: str,
    *,
    ttl_s: float = 60.0,
    verify_every: int = VERIFY_EVERY_TICKS,
    clock: FakeClock | None = None,
) -> LeaderElector:
    if clock is None:
        return LeaderElector(
            queue, name=name, holder=holder, ttl_s=ttl_s, verify_every=verify_every
        )
    return LeaderElector(
        queue, name=name, holder=holder, ttl_s=ttl_s, verify_every=verify_every, clock=clock
    )


async def lease_row(db: DatabaseManager, name: str) -> tuple[str, int] | None:
    """(holder, term) of the lease, or None when there is no row."""
    async with db.connect() as conn:
        row = (
            await conn.execute(
                select(leader_leases.c.holder, leader_leases.c.term).where(
                    leader_leases.c.name == name
                )
            )
        ).first()
    return None if row is None else (row.holder, row.term)


async def expire_lease(db: DatabaseManager, name: str) -> None:
    """Make the lease expired by database time, as if its holder had gone silent."""
    async with db.transaction() as conn:
        await conn.execute(
            update(leader_leases)
            .where(leader_leases.c.name == name)
            .values(expires_at=db.backend.now(plus_s=-1.0))
        )


async def hand_lease_to(db: DatabaseManager, name: str, holder: str) -> None:
    """Give the (unexpired) lease to ``holder`` behind the current holder's back."""
    async with db.transaction() as conn:
        await conn.execute(
            update(leader_leases).where(leader_leases.c.name == name).values(holder=holder)
        )


async def test_one_holder_at_a_time_among_concurrent_candidates(db: DatabaseManager) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    candidates = [elector(queue, name, f"candidate-{i}", verify_every=1) for i in range(CANDIDATES)]
    leaders: set[str] = set()
    for round_no in range(ROUNDS):
        answers = await asyncio.gather(*(c.tick() for c in candidates))
        assert sum(answers) == 1, f"round {round_no}: {answers}"
        leaders |= {c.holder for c, leads in zip(candidates, answers, strict=True) if leads}
    # A live leader keeps its lease: the others never took it.
    assert len(leaders) == 1
    [leader] = leaders
    assert await lease_row(db, name) == (leader, 1)
    # Whenever the lease expires, the whole crowd campaigns and still only one wins.
    for round_no in range(ROUNDS):
        await expire_lease(db, name)
        answers = await asyncio.gather(*(c.tick() for c in candidates))
        assert sum(answers) == 1, f"expired round {round_no}: {answers}"
        [winner] = [c for c, leads in zip(candidates, answers, strict=True) if leads]
        row = await lease_row(db, name)
        assert row is not None and row[0] == winner.holder
        holders = [c.holder for c in candidates if await queue.is_leader(name, c.holder)]
        assert holders == [winner.holder]


async def test_a_second_candidate_takes_over_after_the_ttl_of_a_silent_holder(
    db: DatabaseManager,
) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    ttl_s = 1.0
    first = elector(queue, name, "first", ttl_s=ttl_s)
    second = elector(queue, name, "second", ttl_s=ttl_s)
    asked = time.monotonic()
    assert await first.tick()
    assert not await second.tick()
    # ``first`` goes silent; ``second`` keeps campaigning every tick.
    await wait_for(second.tick, timeout_s=10.0, interval_s=0.05, message="a takeover")
    waited_s = time.monotonic() - asked
    assert waited_s >= ttl_s * 0.95, f"took over after {waited_s:.3f}s, before the TTL"
    assert await lease_row(db, name) == ("second", 2)  # a takeover starts a new term
    # The silent holder learns at its next verification (its cache trusts half a TTL only).
    assert first.is_leader
    assert not await first.tick()
    assert not first.is_leader


async def test_resign_hands_over_at_once(db: DatabaseManager) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    first = elector(queue, name, "first")
    second = elector(queue, name, "second")
    assert await first.tick()
    assert not await second.tick()
    await first.resign()
    assert not first.is_leader
    assert await second.tick()  # no TTL to wait for
    assert await lease_row(db, name) == ("second", 1)


async def test_resigning_after_losing_the_lease_leaves_the_new_holder_alone(
    db: DatabaseManager,
) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    paused = elector(queue, name, "paused")
    successor = elector(queue, name, "successor")
    assert await paused.tick()
    await expire_lease(db, name)
    assert await successor.tick()
    await paused.resign()  # still believes it leads, but the row is the successor's
    assert await queue.is_leader(name, "successor")
    assert await successor.tick()


async def test_cached_leadership_is_reverified_every_five_ticks(db: DatabaseManager) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    clock = FakeClock()
    leader = elector(queue, name, "leader", clock=clock)
    assert await leader.tick()  # verified with the database
    await hand_lease_to(db, name, "usurper")
    # The next four ticks answer from the cache: they do not see the usurper...
    for tick in range(2, VERIFY_EVERY_TICKS + 1):
        assert await leader.tick(), f"tick {tick} should answer from the cache"
    # ...and the fifth after the verification asks the database again.
    assert not await leader.tick()
    assert not leader.is_leader


async def test_cached_leadership_is_reverified_after_half_the_ttl(db: DatabaseManager) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    clock = FakeClock()
    ttl_s = 60.0
    leader = elector(queue, name, "leader", ttl_s=ttl_s, clock=clock)
    assert await leader.tick()
    await hand_lease_to(db, name, "usurper")
    clock.now += ttl_s / 2 - 0.1
    assert await leader.tick()  # still cached: well inside the lease
    clock.now += 0.2
    assert not await leader.tick()  # half the lease gone: verified, whatever the tick count


async def test_every_tick_of_a_non_leader_asks_the_database(db: DatabaseManager) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    clock = FakeClock()
    leader = elector(queue, name, "leader", clock=clock)
    follower = elector(queue, name, "follower", clock=clock)
    assert await leader.tick()
    for _ in range(3):
        assert not await follower.tick()
    await expire_lease(db, name)
    assert await follower.tick()  # the very next tick, with the clock standing still


async def test_a_ticking_leader_keeps_its_lease_past_many_ttls(db: DatabaseManager) -> None:
    queue = QueueRepo(db)
    name = unique("lease")
    ttl_s = 1.0
    leader = elector(queue, name, "leader", ttl_s=ttl_s)
    follower = elector(queue, name, "follower", ttl_s=ttl_s)
    assert await leader.tick()
    deadline = time.monotonic() + 2.5 * ttl_s
    ticks = 0
    while time.monotonic() < deadline:
        assert await leader.tick(), f"lost the lease after {ticks} ticks"
        assert not await follower.tick(), f"follower took a live lease after {ticks} ticks"
        ticks += 1
        await asyncio.sleep(ttl_s / 10)  # the pace of ticks, not a synchronisation
    assert await lease_row(db, name) == ("leader", 1)


def test_holder_ids_are_unique() -> None:
    ids = {new_holder_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(holder) <= 64 for holder in ids)
