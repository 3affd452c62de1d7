"""Repositories: every SQL statement about one concept, each method its own transaction.

A public method opens its transaction and applies ``with_retry``; a function that runs inside
its caller's transaction ends in ``_txn``. Every transition of a run is one conditional
statement fenced by ``(run_id, attempt)`` whose row count is checked (docs/design.md,
"Invariants"). Methods return the frozen values of :mod:`moorline.db.repos.records`, never rows.

Part of ``db``: it may import the rest of ``db`` and the layers below it, never ``runtime``,
``dispatch``, ``engine`` or anything above.
"""
