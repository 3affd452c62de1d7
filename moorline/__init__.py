"""Moorline: durable, multi-tenant execution for LLM and agent workloads."""

from moorline.errors import (
    BackendUnavailable,
    ConfigError,
    Conflict,
    LimitExceeded,
    MoorlineError,
    NotFound,
)
from moorline.settings import Settings
from moorline.types import RunStatus

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "Conflict",
    "LimitExceeded",
    "MoorlineError",
    "NotFound",
    "RunStatus",
    "Settings",
    "__version__",
]
