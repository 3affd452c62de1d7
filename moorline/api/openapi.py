"""The served OpenAPI document: FastAPI's, with what it cannot derive from the routes.

- A plan name's schema (marked :data:`~moorline.api.schemas.PLAN_NAMES`) gets an ``enum`` of
  the plans configured when the app was built, since the server refuses any other with 422
  ``invalid_request``. The document is built once per app, as FastAPI builds it: a plan that a
  plans file adds later is accepted by the server but listed only after a restart.
- A parameter a route requires and checks itself, in an order of its own (a webhook delivery's
  signature is checked before its delivery id, so a forgery is 401 whatever else it lacks),
  is declared optional to FastAPI and marked :data:`CHECKED_BY_ROUTE` with the schema it must
  fit: the document says it is required, with that schema.
"""

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI

from moorline.api.schemas import PLAN_NAMES

CHECKED_BY_ROUTE = "x-moorline-checked-by-route"
"""``json_schema_extra`` key of a parameter the route requires itself; its value is the
parameter's schema as documented."""


def complete_openapi(app: FastAPI, plans: Iterable[str]) -> None:
    """Make ``app``'s OpenAPI document name ``plans`` and the route-checked parameters."""
    names = sorted(plans)
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            for schema in _schemas(document):
                if schema.pop(PLAN_NAMES, False):
                    schema["enum"] = names
                if isinstance(schema.get("schema"), dict) and CHECKED_BY_ROUTE in schema["schema"]:
                    declared = schema["schema"]
                    schema["required"] = True
                    schema["schema"] = {
                        **declared.pop(CHECKED_BY_ROUTE),
                        **{k: v for k, v in declared.items() if k in ("title", "description")},
                    }
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _schemas(node: Any) -> Iterable[dict[str, Any]]:
    """Every JSON object in ``node``, depth first."""
    pending = [node]
    while pending:
        current = pending.pop()
        if isinstance(current, dict):
            yield current
            pending.extend(current.values())
        elif isinstance(current, list):
            pending.extend(current)
