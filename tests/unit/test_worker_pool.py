"""A worker process's database pool: two kept connections per slot and one per writing loop,
within the same bound."""

from moorline.settings import Settings
from moorline.worker.process import with_worker_pool


def test_a_worker_keeps_two_connections_per_slot_and_one_per_loop_beside_them() -> None:
    # 4 slots (each a run's writes and its event writer's), a claim loop per lane, the outcome
    # commits, the heartbeat and the presence beat.
    pooled = with_worker_pool(Settings(db_max_overflow=20), {"a": 3, "b": 1})
    assert (pooled.db_pool_size, pooled.db_max_overflow) == (13, 12)


def test_the_bound_of_connections_a_process_may_hold_is_unchanged() -> None:
    pooled = with_worker_pool(Settings(), {"a": 64})
    assert (pooled.db_pool_size, pooled.db_max_overflow) == (15, 0)
    small = with_worker_pool(Settings(db_pool_size=2, db_max_overflow=1), {"a": 8})
    assert (small.db_pool_size, small.db_max_overflow) == (3, 0)


def test_a_pool_larger_than_the_slots_need_is_left_alone() -> None:
    pooled = with_worker_pool(Settings(db_pool_size=12, db_max_overflow=3), {"a": 2})
    assert (pooled.db_pool_size, pooled.db_max_overflow) == (12, 3)


def test_every_worker_loop_of_the_process_counts() -> None:
    pooled = with_worker_pool(Settings(db_pool_size=5, db_max_overflow=40), {"a": 4}, loops=3)
    assert (pooled.db_pool_size, pooled.db_max_overflow) == (36, 9)
