"""``bench/children.py``'s round measures every figure, at toy size, on SQLite.

A change that breaks the benchmark (an API it uses, a figure it no longer returns) fails here
in seconds instead of in the next run of the script.
"""

from pathlib import Path

from moorline.benchmarks import children


async def test_a_round_gives_every_figure(tmp_path: Path) -> None:
    found = await children.children_round(
        f"sqlite+aiosqlite:///{tmp_path}/bench.db", "memory", children=5, resumes=1
    )
    assert set(found) == {key for key, *_ in children.LINES} - {"resume_p50"} | {"resume"}
    assert len(found["resume"]) == 2
    assert all(value > 0 for values in found.values() for value in values), found
