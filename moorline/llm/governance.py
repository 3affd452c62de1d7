"""The one hook every model call goes through: budgets, provider limits, usage.

A model implementation wraps each call in :func:`governed` and puts the call's
:class:`~moorline.usage.Usage` in its slot. Every call, governed or not, is then counted for
the step that made it (:func:`moorline.llm.usage.report`, stored with the step's checkpoint)
and on its trace span. What else happens around the call is the :class:`CallHook` of the run
the call is made in, which the engine's runner installs for the workflow's task
(:func:`governing`); outside a run, or in a process that installed no hook, there is none, so
the models stay usable on their own.

The hook is told three things, each with a :class:`CallRequest` (model, tenant, weight,
estimated tokens):

- :meth:`CallHook.before`, before the request is sent: it may refuse the call
  (:class:`~moorline.errors.BudgetExceeded`) or wait for provider capacity. A wait longer
  than the request's ``park_after_s`` is not slept through: the hook raises
  :class:`~moorline.llm.limiter.CapacityWait`, and the run parks until then
  (:class:`CapacityParking`, the run's context), holding no slot; its next attempt replays to
  the same call and asks again;
- :meth:`CallHook.rate_limited`, when the provider answered 429 (with its ``Retry-After``);
- :meth:`CallHook.after`, once the call is over, with the usage the provider reported (None
  when it reported none), even when the call failed or the stream was left early.

The worker's hook (:class:`moorline.worker.governor.Governor`) charges budgets and takes
capacity from the shared :mod:`~moorline.llm.limiter`.
"""

import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from moorline.llm.base import Message
from moorline.llm.limiter import CapacityWait, estimate_tokens
from moorline.llm.usage import report
from moorline.observability import tracing
from moorline.usage import Usage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """Whose model calls these are: the run's tenant and its weight (the plan's priority)."""

    tenant_id: str
    weight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CallRequest:
    """One model call as the hook sees it.

    Attributes:
        model: The model asked.
        caller: The run's tenant and weight.
        estimated_tokens: Prompt characters / 4 plus ``max_tokens``: what the limiter
            reserves, and the most the call may add to a budget beyond what it was allowed.
        park_after_s: A wait for capacity longer than this parks the run instead
            (:class:`~moorline.llm.limiter.CapacityWait`); None: the call cannot park.
    """

    model: str
    caller: Caller
    estimated_tokens: int
    park_after_s: float | None = None


class CapacityParking(Protocol):
    """Parks the run for provider capacity: the run's context (:mod:`moorline.engine.waits`)."""

    @property
    def park_after_s(self) -> float:
        """Seconds of waiting for capacity after which the run parks instead."""
        ...

    async def park_for_capacity(self, model: str, wait_s: float) -> None:
        """Park the run for ``wait_s``; return if that wait is already over.

        Raises:
            RunParked: The run is ``waiting`` now; the attempt ends.
        """
        ...


class CallHook(Protocol):
    """What runs around every model call of a run."""

    async def before(self, request: CallRequest) -> None:
        """Admit the call: return when it may start.

        Raises:
            BudgetExceeded: the tenant's daily budget is spent; the call does not start.
        """
        ...

    async def rate_limited(self, request: CallRequest, retry_after_s: float) -> None:
        """The provider answered 429, asking for ``retry_after_s`` seconds of quiet."""
        ...

    async def after(self, request: CallRequest, usage: Usage | None) -> None:
        """The call is over; ``usage`` is what the provider reported (None: nothing)."""
        ...


@dataclass(slots=True)
class CallSlot:
    """Where a model implementation puts what it learns during a governed call."""

    request: CallRequest | None
    usage: Usage | None = None

    @contextmanager
    def sending(self) -> Iterator[None]:
        """Mark this call as the one being sent, for :func:`provider_rate_limited`.

        Held only around the request itself (no ``yield`` of a stream inside), so the mark
        never leaks into the code that consumes the stream.
        """
        token = _SENDING.set(self)
        try:
            yield
        finally:
            _SENDING.reset(token)


@dataclass(frozen=True, slots=True)
class _Scope:
    hook: CallHook
    caller: Caller
    parking: CapacityParking | None


_SCOPE: ContextVar[_Scope | None] = ContextVar("moorline_call_hook", default=None)
_SENDING: ContextVar[CallSlot | None] = ContextVar("moorline_call_sending", default=None)


async def provider_rate_limited(retry_after_s: float) -> None:
    """The provider answered 429 to the call being sent: tell its hook (else nothing).

    Called from the HTTP client's response hook, which runs in the sending task, so the SDK's
    own retries of the 429 are seen too, each one.
    """
    slot = _SENDING.get()
    scope = _SCOPE.get()
    if slot is not None and slot.request is not None and scope is not None:
        await scope.hook.rate_limited(slot.request, retry_after_s)


@contextmanager
def governing(
    hook: CallHook | None, caller: Caller, parking: CapacityParking | None = None
) -> Iterator[None]:
    """Make ``hook`` govern the model calls made in this context (a run's workflow task).

    With ``parking``, a long wait for provider capacity parks the run instead.
    """
    if hook is None:
        yield
        return
    token = _SCOPE.set(_Scope(hook, caller, parking))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def prompt_chars(messages: Sequence[Message]) -> int:
    """Characters of the chat sent to the model (its content and tool calls' arguments)."""
    return sum(
        len(message.content) + sum(len(str(call.arguments)) for call in message.tool_calls)
        for message in messages
    )


@asynccontextmanager
async def governed(
    model: str, messages: Sequence[Message], *, max_tokens: int | None = None
) -> AsyncIterator[CallSlot]:
    """Run one model call under the current run's hook; put its usage in the slot.

    Raises:
        BudgetExceeded: from the hook, before the call starts.
        RunParked: the wait for provider capacity is longer than ``park_after``.
    """
    scope = _SCOPE.get()
    if scope is None:
        ungoverned = CallSlot(None)
        try:
            yield ungoverned
        finally:
            _account(ungoverned, model)
        return
    hook, parking = scope.hook, scope.parking
    request = CallRequest(
        model=model,
        caller=scope.caller,
        estimated_tokens=estimate_tokens(prompt_chars(messages), max_tokens),
        park_after_s=None if parking is None else parking.park_after_s,
    )
    while True:
        try:
            await hook.before(request)
            break
        except CapacityWait as wait:
            if parking is None:  # pragma: no cover - only a request that may park is told
                raise
            # Raises RunParked; returns only when the wait is over by the database's clock.
            await parking.park_for_capacity(model, wait.wait_s)
    slot = CallSlot(request)
    try:
        yield slot
    finally:
        _account(slot, model)
        try:
            await hook.after(request, slot.usage)
        except Exception:
            # The call's answer stands; a spend that could not be recorded is logged.
            logger.exception("model %s: the call's usage could not be recorded", model)


def _account(slot: CallSlot, model: str) -> None:
    """Count the call for its step (:func:`~moorline.llm.usage.report`) and its span.

    A call whose implementation put no usage in the slot (it failed before it knew any) is
    counted as one failed call of 0 tokens: the provider may have billed it.
    """
    usage = slot.usage if slot.usage is not None else Usage(model=model, ok=False)
    report(usage)
    tracing.record_usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens)
