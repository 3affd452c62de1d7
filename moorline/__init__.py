"""Moorline: durable, multi-tenant execution for LLM and agent workloads."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moorline.client import Client, SyncClient
    from moorline.engine.context import Cancelled, Context
    from moorline.engine.permissions import Decision
    from moorline.engine.registry import Moorline
    from moorline.engine.submitting import Submission, Submitted
    from moorline.errors import (
        BackendUnavailable,
        BudgetExceeded,
        ConfigError,
        Conflict,
        LimitExceeded,
        MoorlineError,
        NotFound,
        SoftTimeLimitExceeded,
    )
    from moorline.settings import Settings
    from moorline.types import RunStatus

    __version__: str

_MODULE_OF = {
    "BackendUnavailable": "moorline.errors",
    "BudgetExceeded": "moorline.errors",
    "Cancelled": "moorline.engine.context",
    "ChildFailed": "moorline.errors",
    "Client": "moorline.client",
    "ConfigError": "moorline.errors",
    "Conflict": "moorline.errors",
    "Context": "moorline.engine.context",
    "Decision": "moorline.engine.permissions",
    "LimitExceeded": "moorline.errors",
    "Moorline": "moorline.engine.registry",
    "MoorlineError": "moorline.errors",
    "NotFound": "moorline.errors",
    "RunParked": "moorline.errors",
    "RunStatus": "moorline.types",
    "Settings": "moorline.settings",
    "Submission": "moorline.engine.submitting",
    "Submitted": "moorline.engine.submitting",
    "SoftTimeLimitExceeded": "moorline.errors",
    "SyncClient": "moorline.client",
}
"""Where each public name lives. Imported on first use (PEP 562): every ``moorline`` process
imports this package, and a client command needs neither the engine nor the database layer,
nor a worker the HTTP client."""


def _read_version() -> str:
    """The installed distribution's version: pyproject.toml's ``version`` is the only copy."""
    from importlib import metadata

    try:
        return metadata.version("moorline")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # Read on first use, like the names above: scanning the installed distributions costs
        # every process start, and few processes ever ask for the version.
        globals()[name] = version = _read_version()
        return version
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'moorline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


__all__ = [
    "BackendUnavailable",
    "BudgetExceeded",
    "Cancelled",
    "ChildFailed",
    "Client",
    "ConfigError",
    "Conflict",
    "Context",
    "Decision",
    "LimitExceeded",
    "Moorline",
    "MoorlineError",
    "NotFound",
    "RunParked",
    "RunStatus",
    "Settings",
    "SoftTimeLimitExceeded",
    "Submission",
    "Submitted",
    "SyncClient",
    "__version__",
]
