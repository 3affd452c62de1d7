"""Dispatch figures per backend: enqueue rate, drain rate, dispatch latency (issue 3).

The measuring code is :mod:`moorline.benchmarks.dispatch` (shared with ``moorline bench``);
see it for what each figure means and the options.

    .venv/bin/python bench/dispatch.py [--rounds 3] [--backends sqlite,postgresql,mysql]
"""

from moorline.benchmarks.dispatch import main

if __name__ == "__main__":
    main()
