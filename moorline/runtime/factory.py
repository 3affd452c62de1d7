"""Build the RuntimeStore the settings ask for."""

from moorline.runtime.base import RuntimeStore
from moorline.runtime.memory import InMemoryRuntimeStore
from moorline.settings import Settings


def make_runtime_store(settings: Settings) -> RuntimeStore:
    """The Redis store when ``MOORLINE_REDIS_URL`` is set, else the in-memory store.

    Cancel flags and message queues live as long as a run may (``execution_timeout``). The
    caller owns the store and closes it (:meth:`RuntimeStore.close`).
    """
    if settings.redis_url:
        # Imported here so that the in-memory default works without the redis package.
        from moorline.runtime.redis import RedisRuntimeStore

        return RedisRuntimeStore(
            settings.redis_url,
            prefix=settings.redis_prefix,
            retention_s=settings.execution_timeout,
        )
    return InMemoryRuntimeStore(retention_s=settings.execution_timeout)
