"""The benchmark suite behind ``moorline bench`` and the ``bench/`` scripts.

The measuring code lives in the package, not in ``bench/``, for three reasons: ``moorline bench``
must work from an installed wheel (where no repository is around to find scripts in), mypy and
the import contracts check it like the rest of the code, and one copy serves both the command
(structured results, reports) and the scripts (``python bench/dispatch.py`` prints the same
figures as before). ``bench/`` keeps the thin script front-ends and the one-off comparisons that
are not part of the report (``db_commit.py``, ``enqueue.py``).

Nothing here is imported by the server or the worker.
"""
