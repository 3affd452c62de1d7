"""Admission: whether a trigger becomes a run (rate limits, daily quotas, idempotency).

Owns :class:`~moorline.admission.admit.Admission` (every trigger, from HTTP, a webhook or the
client, takes the same steps), the daily quota stores, the API rate limits through ``limits``,
and the gate that settles a batch's Redis counters in one round trip.

Layer: beside ``worker`` (neither imports the other). It may import ``dispatch``, ``engine``
and everything below them (``lint-imports``; see docs/design.md, "Layers").
"""
