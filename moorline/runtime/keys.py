"""Every Redis key and channel name of the runtime store. The formats are persisted contract.

All names start with the configured prefix (``MOORLINE_REDIS_PREFIX``, default ``mo``). The
entity follows in a ``{hash tag}``, so every key of one conversation, or of one run, lands in the
same Redis Cluster slot and multi-key scripts never fail with ``CROSSSLOT``::

    <prefix>:{conv:<tenant_id>:<conversation_id>}:lease        STRING holder  TTL of the lease
    <prefix>:{conv:<tenant_id>:<conversation_id>}:interactive  STRING run id  TTL of the window
    <prefix>:{run:<run_id>}:interrupt:<interrupt_id> HASH status, decision    TTL of the interrupt
    <prefix>:{run:<run_id>}:interrupts               SET interrupt ids        longest interrupt TTL
    <prefix>:{run:<run_id>}:cancel                   STRING "1"               retention
    <prefix>:{run:<run_id>}:inbox                    HASH seq → message text  retention
    <prefix>:{run:<run_id>}:signal                   channel: interrupt:<id> | cancel | cleanup
    <prefix>:{run:<run_id>}:events                   channel: JSON events
    <prefix>:{tenant:<tenant_id>}:quota:<YYYY-MM-DD> STRING units used        past the UTC day
    <prefix>:{tenant:<tenant_id>}:budget:<YYYY-MM-DD> HASH tokens, cost_micros past the UTC day
    <prefix>:{llm:<model>}:limiter                   HASH buckets, pause, clock    LIMITER_TTL
    <prefix>:{llm:<model>}:queue                     ZSET waiter → fair tag        LIMITER_TTL
    <prefix>:{llm:<model>}:seen                      ZSET waiter → last poll (ms)  LIMITER_TTL
    <prefix>:{llm:<model>}:tags                      HASH tenant → last fair tag   LIMITER_TTL
    <prefix>:ratelimit:<limits library key>          the ``limits`` library   its window

A conversation is named with its tenant (``runtime.base.conversation_key``): two tenants may
use the same conversation id. A run without a conversation uses its run id as its window's name.
Every key of a run starts with the same ``<prefix>:{run:<run_id>}``, so the hash tag is the
same for all of them whatever characters the id contains. The quota, budget and rate-limit keys
belong to admission (:mod:`moorline.admission`) and the provider limiter's to
:mod:`moorline.llm.limiter`, not to the runtime store; they are built here so that
every Redis name Moorline writes is in one place.
"""

from dataclasses import dataclass

from moorline.types import RunId, TenantId


@dataclass(frozen=True, slots=True)
class RedisKeys:
    """Key and channel builders under one prefix."""

    prefix: str

    def _conversation(self, conversation_id: str) -> str:
        return f"{self.prefix}:{{conv:{conversation_id}}}"

    def _run(self, run_id: RunId) -> str:
        return f"{self.prefix}:{{run:{run_id}}}"

    def lease(self, conversation_id: str) -> str:
        """The conversation lease: the holder, with the lease TTL."""
        return f"{self._conversation(conversation_id)}:lease"

    def interactive(self, conversation_id: str) -> str:
        """The interactive window: the run whose engine loop is live."""
        return f"{self._conversation(conversation_id)}:interactive"

    def interrupt(self, run_id: RunId, interrupt_id: str) -> str:
        """One interrupt: a hash of ``status`` and, once resolved, ``decision``."""
        return f"{self._run(run_id)}:interrupt:{interrupt_id}"

    def interrupt_index(self, run_id: RunId) -> str:
        """The ids of the run's interrupts, so that cleanup finds them without a SCAN."""
        return f"{self._run(run_id)}:interrupts"

    def cancel(self, run_id: RunId) -> str:
        """The run's cancel flag."""
        return f"{self._run(run_id)}:cancel"

    def messages(self, run_id: RunId) -> str:
        """The run's injected-message signals: a hash of message ``seq`` → text."""
        return f"{self._run(run_id)}:inbox"

    def signal_channel(self, run_id: RunId) -> str:
        """Pub/Sub channel that wakes the run's waiters; the state in the keys is the truth."""
        return f"{self._run(run_id)}:signal"

    def events_channel(self, run_id: RunId) -> str:
        """Pub/Sub channel of the run's live events."""
        return f"{self._run(run_id)}:events"

    def quota(self, tenant_id: TenantId, day: str) -> str:
        """The tenant's quota counter for one UTC day (``YYYY-MM-DD``)."""
        return f"{self.prefix}:{{tenant:{tenant_id}}}:quota:{day}"

    def budget(self, tenant_id: TenantId, day: str) -> str:
        """The tenant's model spend for one UTC day: a hash of ``tokens`` and ``cost_micros``."""
        return f"{self.prefix}:{{tenant:{tenant_id}}}:budget:{day}"

    def limiter(self, model: str) -> tuple[str, str, str, str]:
        """The provider limiter's keys of one model: state, queue, seen, tags (one slot)."""
        base = f"{self.prefix}:{{llm:{model}}}"
        return f"{base}:limiter", f"{base}:queue", f"{base}:seen", f"{base}:tags"

    def rate_limits(self) -> str:
        """The key prefix handed to the ``limits`` library for API rate-limit windows."""
        return f"{self.prefix}:ratelimit"

    def pattern(self) -> str:
        """A SCAN pattern that matches every key under this prefix."""
        return f"{self.prefix}:*"


SIGNAL_CANCEL = "cancel"
SIGNAL_CLEANUP = "cleanup"
SIGNAL_INTERRUPT = "interrupt:"
"""Signal payloads: ``interrupt:<id>`` when that interrupt is resolved."""
