"""The engine: workflows and what runs them, one attempt at a time.

Owns the user's ``Moorline`` app and its workflow registry, ``Context`` (steps and their
checkpoints, interrupts, injected messages, events), the
:class:`~moorline.engine.runner.Runner` seam the worker calls once per attempt, time limits and
the cancel grace, conversations at run time, and reading a run's events as a stream.

Layer: beside ``dispatch`` (neither imports the other). It may import ``db``, ``runtime``,
``llm``, ``plans``, ``observability``, ``settings``, ``concurrency``, ``errors`` and ``types``;
the API may import only its read side, never ``engine.runner`` or ``engine.context``
(``lint-imports``; see docs/design.md, "Layers").
"""
