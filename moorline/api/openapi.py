"""The served OpenAPI document: FastAPI's, with what it cannot derive from the routes.

A plan name's schema (marked :data:`~moorline.api.schemas.PLAN_NAMES`) gets an ``enum`` of the
plans configured when the app was built, since the server refuses any other with 422
``invalid_request``. The document is built once per app, as FastAPI builds it: a plan that a
plans file adds later is accepted by the server but listed only after a restart.
"""

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI

from moorline.api.schemas import PLAN_NAMES


def list_plans_in_openapi(app: FastAPI, plans: Iterable[str]) -> None:
    """Make ``app``'s OpenAPI document name ``plans`` as the only plan names."""
    names = sorted(plans)
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            for schema in _schemas(document):
                if schema.pop(PLAN_NAMES, False):
                    schema["enum"] = names
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
