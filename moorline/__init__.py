"""Moorline: durable, multi-tenant execution for LLM and agent workloads."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moorline.client import Client
    from moorline.engine.context import Cancelled, Context, Decision
    from moorline.engine.registry import Moorline
    from moorline.errors import (
        BackendUnavailable,
        ConfigError,
        Conflict,
        LimitExceeded,
        MoorlineError,
        NotFound,
        SoftTimeLimitExceeded,
    )
    from moorline.settings import Settings
    from moorline.types import RunStatus

__version__ = "0.1.0"

_MODULE_OF = {
    "BackendUnavailable": "moorline.errors",
    "Cancelled": "moorline.engine.context",
    "Client": "moorline.client",
    "ConfigError": "moorline.errors",
    "Conflict": "moorline.errors",
    "Context": "moorline.engine.context",
    "Decision": "moorline.engine.context",
    "LimitExceeded": "moorline.errors",
    "Moorline": "moorline.engine.registry",
    "MoorlineError": "moorline.errors",
    "NotFound": "moorline.errors",
    "RunStatus": "moorline.types",
    "Settings": "moorline.settings",
    "SoftTimeLimitExceeded": "moorline.errors",
}
"""Where each public name lives. Imported on first use (PEP 562): every ``moorline`` process
imports this package, and a client command needs neither the engine nor the database layer,
nor a worker the HTTP client."""


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'moorline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "BackendUnavailable",
    "Cancelled",
    "Client",
    "ConfigError",
    "Conflict",
    "Context",
    "Decision",
    "LimitExceeded",
    "Moorline",
    "MoorlineError",
    "NotFound",
    "RunStatus",
    "Settings",
    "SoftTimeLimitExceeded",
    "__version__",
]
