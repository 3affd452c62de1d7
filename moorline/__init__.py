"""Moorline: durable, multi-tenant execution for LLM and agent workloads."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from moorline.client import Client

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The HTTP client (httpx, its result models) is imported on first use: `python -m moorline
    # worker` imports this package and never talks HTTP.
    if name == "Client":
        from moorline.client import Client

        return Client
    raise AttributeError(f"module 'moorline' has no attribute {name!r}")


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
