"""The worker process: lanes with their own slots, claims, heartbeats, shutdown.

Owns :class:`Worker` (claims a batch per lane, holds each run's lease by heartbeat, fences
itself when a renewal fails, drains on SIGTERM), the group commit of run outcomes, and the
process that ``moorline worker`` runs (database, plans, wake-ups, the reaper loop).

Layer: beside ``admission`` (neither imports the other). It may import ``dispatch`` and
``engine`` and everything below them; the API never imports it (``lint-imports``; see
docs/design.md, "Layers").
"""
