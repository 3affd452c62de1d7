"""Suspension figures per backend (issue 16): parked resume, timer lateness, waiting load, replay.

The measuring code is :mod:`moorline.benchmarks.suspension` (resume, timers, replay) and
:mod:`moorline.benchmarks.waiting_load` (claims and drain with waiting runs stored); see them
for what each figure means and which path it measures.

    .venv/bin/python bench/suspension.py [--rounds 3] [--backends sqlite,postgresql,mysql]
        [--figures resume,load,replay] [--full | --waiting-rows N] [--quick]

(or ``moorline bench --benchmarks parked_resume`` for the resume figure in the report).
"""

from moorline.benchmarks.suspension import main

if __name__ == "__main__":
    main()
