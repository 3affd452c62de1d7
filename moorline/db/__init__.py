"""The database layer: the source of truth for runs, steps, events, tenants and quotas.

Owns ``DatabaseManager`` (engines and pools, primary-first failover, ``with_retry``), one
backend class per database (:mod:`moorline.db.backends`), the schema (the only one) and its
Alembic migrations, the drivers' fast connections, readiness, and the repositories, each of
which opens its own transactions and returns frozen values.

Layer: beside ``runtime`` and ``llm`` (none imports another). It may import only ``plans``,
``observability``, ``settings``, ``concurrency``, ``errors`` and ``types`` (``lint-imports``;
see docs/design.md, "Layers").
"""
