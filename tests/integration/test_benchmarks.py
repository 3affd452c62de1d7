"""Every benchmark of ``moorline bench`` measures something, at toy sizes, on SQLite in memory.

``test_bench_cli`` runs the command end to end for one benchmark; this runs each benchmark's
round once, in process, so a change that breaks one (an API it uses, a figure it no longer
returns) fails here in seconds instead of in the next full ``make bench``.
"""

import json
from pathlib import Path

from moorline.benchmarks import dispatch, engine, suspension, waiting_load
from moorline.benchmarks.suite import BENCHMARKS, METRICS, Report, Target, plan

TOY_DISPATCH = dispatch.DispatchSizes(
    enqueue_runs=40, producers=4, drain_runs=40, slots=8, rate=40.0, latency_seconds=0.3
)
TOY_ENGINE = engine.EngineSizes(
    steps=5, interrupts=2, deltas=50, fanout_deltas=10, fanout_readers=5
)


async def test_each_round_gives_its_figures(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/bench-%s.db"
    found: dict[str, float] = {}
    found |= await dispatch.enqueue_round(url % "enqueue", TOY_DISPATCH)
    found |= await dispatch.drain_round(url % "drain", TOY_DISPATCH)
    found |= await dispatch.latency_round(url % "latency", TOY_DISPATCH)
    found |= await engine.step_round(url % "step", TOY_ENGINE)
    found |= await engine.resume_round(url % "resume", "memory", TOY_ENGINE)
    found |= await engine.events_round(url % "events", "memory", TOY_ENGINE)
    found |= await suspension.resume_round(url % "parked", "memory", parked=2)
    assert set(found) == set(METRICS)
    assert all(value > 0 for value in found.values()), found
    assert found["latency_p50"] <= found["latency_p99"]


def test_plan_pairs_stores_with_their_database() -> None:
    chosen = list(plan(["step", "resume"], ["sqlite"], ["memory", "redis"]))
    # Redis is measured with PostgreSQL, which was not chosen: left out.
    assert [(b.name, t.label) for b, t in chosen] == [
        ("step", "sqlite"),
        ("resume", "memory+sqlite"),
    ]
    assert len(list(plan(list(BENCHMARKS), ["sqlite", "postgresql", "mysql"], ["redis"]))) == 15


def test_report_table_has_a_column_per_target(tmp_path: Path) -> None:
    report = Report(rounds=3, quick=True)
    report.add("step", Target("sqlite"), {"step": [1.0, 3.0, 2.0]})
    report.add("resume", Target("sqlite", "memory"), {"resolve_resume": [5.0, 4.0, 6.0]})
    report.write(tmp_path / "r.md", tmp_path / "r.json")
    lines = (tmp_path / "r.md").read_text().splitlines()
    assert "| Figure | sqlite | memory+sqlite |" in lines
    assert "| Step overhead (ms, lower is better) | 2.00 (1.00-3.00) | - |" in lines
    assert "| Resolve → resume (ms, lower is better) | - | 5.00 (4.00-6.00) |" in lines
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["metric"], r["target"], r["median"]) for r in results] == [
        ("step", "sqlite", 2.0),
        ("resolve_resume", "memory+sqlite", 5.0),
    ]


async def test_suspension_script_rounds_give_their_figures(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/bench-%s.db"
    toy = waiting_load.LoadSizes(waiting_rows=50, claims=5, drain_runs=10, slots=4)
    loaded = await waiting_load.load_round(url % "load", 50, toy)
    assert set(loaded) == {
        "bytes_per_waiting_row",
        "claim_p50",
        "claim_p99",
        "drain",
        "drain_cpu",
    }
    replayed = await suspension.replay_round(url % "replay", "memory", samples=1)
    assert set(replayed) == {"replay_2", "replay_200"}
    assert all(value > 0 for value in (loaded | replayed).values())
