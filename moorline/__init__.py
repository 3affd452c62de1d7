"""Moorline: durable, multi-tenant execution for LLM and agent workloads."""

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
