"""Dispatch: getting runs to workers and back, durably.

Owns enqueueing (the Submitter's group commit and a run's routing by plan), cancelling (the
database first, then the signal), lanes and their slots, the retry policy, leader election,
the reaper, and wake-ups (a hint that a lane has work; never the source of truth).

Layer: beside ``engine`` (neither imports the other). It may import ``db``, ``runtime``,
``llm``, ``plans``, ``observability``, ``settings``, ``concurrency``, ``errors`` and ``types``
(``lint-imports``; see docs/design.md, "Layers").
"""
