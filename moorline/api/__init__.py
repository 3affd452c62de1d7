"""HTTP API v1 (FastAPI): routes, authentication, input limits, errors, SSE, the dashboard.

Owns ``create_app``, one router module per resource under ``routes/``, the request and response
bodies (:mod:`moorline.api.schemas`, whose field names are contract), the guards that refuse
bad input before any route runs, and :mod:`moorline.api.errors`, the only place an error
becomes an HTTP response. The contract is docs/api.md.

Layer: under ``cli`` and ``benchmarks``. It may import ``admission``, ``dispatch``, ``engine``
(its read side) and everything below them, but never ``worker``, ``engine.runner`` or
``engine.context``: the API never runs workflow code (``lint-imports``).
"""
