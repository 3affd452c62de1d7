"""``moorline serve`` and ``moorline worker`` take what their start made out of the GC's passes.

:func:`~moorline.worker.process.freeze_start_up_objects` runs once a process has started: a
full pass of the cyclic collector then visits only what was made since (docs/performance.md
has what that saved). Checked in a fresh interpreter, since freezing is for the whole
process: the start's objects leave the collector's generations, and garbage made before is
still collected, not frozen with them.
"""

import json
import subprocess
import sys

PROBE = """
import gc
import json
import weakref

import moorline.api.app  # what a server imports
from moorline.worker.process import freeze_start_up_objects

class Node:
    pass

gc.collect()
before = len(gc.get_objects())
cycle = Node()
cycle.self = cycle  # garbage only the collector frees
dead = weakref.ref(cycle)
del cycle
freeze_start_up_objects()
print(json.dumps({
    "tracked_before": before,
    "tracked_after": len(gc.get_objects()),
    "frozen": gc.get_freeze_count(),
    "garbage_freed": dead() is None,
}))
"""


def test_the_start_up_objects_leave_the_collectors_generations() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    found = json.loads(done.stdout)
    assert found["tracked_before"] > 50_000  # what a full pass visited
    assert found["tracked_after"] < 1_000
    assert found["frozen"] >= found["tracked_before"] * 0.9
    assert found["garbage_freed"]
