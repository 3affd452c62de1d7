"""Engine figures (issue 4): checkpoint overhead, interrupt resume latency, event stream rate.

The measuring code is :mod:`moorline.benchmarks.engine` (shared with ``moorline bench``); see
it for what each figure means and the options.

    .venv/bin/python bench/engine.py [--rounds 3] [--only step,resume,events]
"""

from moorline.benchmarks.engine import main

if __name__ == "__main__":
    main()
