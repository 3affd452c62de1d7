"""Runtime coordination (leases, interrupts, cancels, messages, live events): memory or Redis.

The Redis implementation lives in :mod:`moorline.runtime.redis`, imported only when used so
that the in-memory default needs no Redis client.
"""

from moorline.runtime.base import (
    CANCELLED_DECISION,
    EventSubscription,
    InterruptState,
    InterruptStatus,
    LeaseAcquisition,
    QueuedMessage,
    RuntimeStore,
    StoreShutdown,
    WindowChange,
)
from moorline.runtime.factory import make_runtime_store
from moorline.runtime.memory import InMemoryRuntimeStore

__all__ = [
    "CANCELLED_DECISION",
    "EventSubscription",
    "InMemoryRuntimeStore",
    "InterruptState",
    "InterruptStatus",
    "LeaseAcquisition",
    "QueuedMessage",
    "RuntimeStore",
    "StoreShutdown",
    "WindowChange",
    "make_runtime_store",
]
