"""The ``moorline`` command line (Typer): serve, worker, client commands, db, bench.

Owns the process edges: it builds ``Settings``, the ``DatabaseManager``, the runtime store and
the app once and passes them down, and runs ``asyncio.run``. Client commands reach a server
only through :class:`moorline.Client`. Every expected failure is one line on stderr and a
non-zero exit.

Layer: the top one; it may import every package of ``moorline`` (``lint-imports``).
"""
