"""The many-process RuntimeStore on Redis (``redis.asyncio``).

- Keys come from :mod:`moorline.runtime.keys`: one ``{hash tag}`` per conversation or run, so
  the store works on Redis Cluster. Every key is written with a TTL in the same atomic step.
- Every compare-and-set is a Lua script from ``runtime/lua/``, registered with redis-py's
  ``register_script``: it runs EVALSHA and falls back to loading the script on ``NOSCRIPT``, so
  a ``SCRIPT FLUSH`` or a fail-over to a fresh replica costs one extra round trip.
- Waits follow subscribe-then-re-check, because Pub/Sub is at-most-once: the waker writes the
  state first and then publishes (one script); the waiter checks the state, subscribes to the
  run's signal channel, waits until Redis confirms the subscription, checks again, and only
  then waits for a signal, re-checking on every signal and at least every ``poll_interval_s``.
  A signal published before the subscription is therefore never needed.
- All subscriptions of a store share one Pub/Sub connection
  (:class:`~moorline.runtime.pubsub.PubSubHub`). When it breaks, every waiter opens its
  subscription again on a fresh connection and re-checks; event subscriptions are cut off and
  resume from the database. When Redis stays away a waiter keeps trying until its deadline,
  then raises :class:`~moorline.errors.BackendUnavailable`.
- Live events go out as one ``PUBLISH`` per batch and come in through
  :class:`~moorline.runtime.pubsub.EventFeeds`: one channel subscription per run and process,
  whatever the number of local subscribers.
- Injected-message signals live in a hash ``seq → text``: pushing a ``seq`` twice (a command
  retried after its reply was lost) keeps one entry, and a drain returns them in ``seq`` order.

``RedisError`` never leaves this module: it becomes :class:`~moorline.errors.BackendUnavailable`.
"""

import asyncio
import contextlib
import functools
import json
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from importlib import resources
from typing import Any, Concatenate, ParamSpec, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from moorline.coalescer import Coalescer
from moorline.concurrency import cancel_and_wait, keep_cancel
from moorline.errors import BackendUnavailable
from moorline.runtime.base import (
    CANCELLED_DECISION,
    DEFAULT_EVENT_QUEUE_SIZE,
    DEFAULT_MAX_MESSAGES,
    EventSubscription,
    InterruptState,
    InterruptStatus,
    LeaseAcquisition,
    QueuedMessage,
    RuntimeStore,
    StoreShutdown,
    WindowChange,
    decode_decision,
    encode_decision,
    queue_full,
)
from moorline.runtime.keys import SIGNAL_CANCEL, SIGNAL_CLEANUP, SIGNAL_INTERRUPT, RedisKeys
from moorline.runtime.pubsub import EventFeeds, PubSubHub
from moorline.runtime.redis_client import RedisClient, RedisConnector
from moorline.types import JSONObject, RunId

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

SCRIPT_NAMES = (
    "acquire_lease",
    "check_interrupt",
    "cleanup_run",
    "compare_and_delete",
    "compare_and_expire",
    "drain_all",
    "open_interrupt",
    "push_message",
    "request_cancel",
    "resolve_interrupt",
    "change_window",
)

DEFAULT_POLL_INTERVAL_S = 1.0
RESUBSCRIBE_BACKOFF_S = 0.05
"""First pause before a waiter subscribes again after Redis failed it; doubles each time."""
MAX_RESUBSCRIBE_BACKOFF_S = 1.0
FINAL_CHECK_TIMEOUT_S = 1.0
"""Longest wait for the last check a waiter makes at its deadline."""
SUBSCRIBE_TIMEOUT_S = 10.0
"""Longest wait for an event subscription to be confirmed."""

StepHook = Callable[[str, RunId], Awaitable[None]]
"""Test hook called as ``hook(step, run_id)`` with step ``subscribe``, ``recheck`` or ``wait``."""


def load_script(name: str) -> str:
    """The text of ``runtime/lua/<name>.lua``."""
    return resources.files("moorline.runtime").joinpath("lua", f"{name}.lua").read_text("utf-8")


ScriptCall = tuple[AsyncScript, Sequence[Any], Sequence[Any]]
"""One script call of a pipeline: the script, its keys, its arguments."""


async def run_scripts(client: RedisClient, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run several scripts (each ``(script, keys, args)``) in one round trip: a pipeline.

    The pipeline sends ``EVALSHA`` without the ``SCRIPT EXISTS`` check that redis-py's own
    pipelined scripts do before every execution (a second round trip each time). A script that
    Redis does not know (``NOSCRIPT``: after a ``SCRIPT FLUSH``, a restart or a fail-over) is
    loaded and its calls sent again, which only that case pays for.

    Returns:
        Each call's reply, in order.

    Raises:
        RedisError: Redis did not answer, or a script failed.
    """
    if not calls:
        return []
    replies = await _pipelined(client, calls)
    missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {calls[index][0].sha: calls[index][0] for index in missing}.values():
            await client.script_load(script.script)
        again = await _pipelined(client, [calls[index] for index in missing])
        for index, reply in zip(missing, again, strict=True):
            replies[index] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _pipelined(client: RedisClient, calls: Sequence[ScriptCall]) -> list[Any]:
    if len(calls) == 1:
        # One call (a window change of an idle worker, say): the command alone, which costs
        # redis-py less CPU than a pipeline of one. Its error is a reply, as in a pipeline.
        ((script, keys, args),) = calls
        try:
            return [await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)]
        except ResponseError as exc:
            return [exc]
    pipeline = client.pipeline(transaction=False)
    for script, keys, args in calls:
        # The command itself, not ``pipeline.evalsha``: redis-py's cluster pipeline refuses
        # that method, though it routes EVALSHA by its keys like any keyed command (each call
        # here touches the keys of one slot; the pipeline sends each node its share).
        pipeline.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    replies: list[Any] = await pipeline.execute(raise_on_error=False)
    return replies


def to_ms(ttl_s: float) -> int:
    """A TTL in whole milliseconds, at least 1 (Redis refuses 0)."""
    return max(1, math.ceil(ttl_s * 1000))


def _translate(
    method: Callable[Concatenate["RedisRuntimeStore", P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate["RedisRuntimeStore", P], Coroutine[Any, Any, R]]:
    """Turn a ``RedisError`` escaping ``method`` into ``BackendUnavailable``."""

    @functools.wraps(method)
    async def wrapper(self: "RedisRuntimeStore", /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await keep_cancel(method(self, *args, **kwargs))
        except RedisError as exc:
            raise BackendUnavailable(f"Redis runtime store: {method.__name__}: {exc}") from exc

    return wrapper


class _Wake:
    """A waiter's listener: its event is set by a relevant signal or a broken connection."""

    def __init__(self, wakes_on: frozenset[str]) -> None:
        self.event = asyncio.Event()
        self.is_broken = False
        self._wakes_on = wakes_on

    def on_message(self, data: str) -> None:
        if data in self._wakes_on:
            self.event.set()

    def on_broken(self) -> None:
        self.is_broken = True
        self.event.set()


class RedisRuntimeStore(RuntimeStore):
    """RuntimeStore shared by many processes through Redis.

    Args:
        url: ``MOORLINE_REDIS_URL``: one server, Sentinel or Cluster
            (:mod:`moorline.runtime.redis_client`).
        prefix: Start of every key and channel (``MOORLINE_REDIS_PREFIX``).
        retention_s: TTL of cancel flags and message queues (the execution timeout).
        poll_interval_s: Longest time a waiter goes without re-checking the state; bounds the
            delay of a wake-up whose signal was lost.
        event_queue_size: Events a live subscriber may fall behind by before it is cut off.
        client_name: ``CLIENT SETNAME`` of every connection, to find them in ``CLIENT LIST``.
        max_connections: Command connections; callers beyond it wait for a free one.
        max_messages: Injected-message signals a run may have queued.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "mo",
        retention_s: float = 1800.0,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        event_queue_size: int = DEFAULT_EVENT_QUEUE_SIZE,
        client_name: str | None = None,
        max_connections: int = 50,
        max_messages: int = DEFAULT_MAX_MESSAGES,
    ) -> None:
        # Commands retry a few times on a dropped connection; Pub/Sub never retries (see
        # PubSubHub). A blocking pool makes a burst wait for a connection instead of failing.
        connector = RedisConnector(url)
        self._client = connector.client(
            decode_responses=True,
            client_name=client_name,
            max_connections=max_connections,
            retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.5), 3),
        )
        self._pubsub_client = connector.pubsub_client(
            self._client, decode_responses=True, client_name=client_name
        )
        self._hub = PubSubHub(functools.partial(connector.pubsub, self._pubsub_client))
        self.client_name = client_name
        self.keys = RedisKeys(prefix)
        self._retention_ms = to_ms(retention_s)
        self._poll_interval_s = poll_interval_s
        self._feeds = EventFeeds(self._hub, self.keys.events_channel, max_queued=event_queue_size)
        self._max_messages = max_messages
        self._scripts: dict[str, AsyncScript] = {
            name: self._client.register_script(load_script(name)) for name in SCRIPT_NAMES
        }
        self._watches: set[asyncio.Task[Any]] = set()
        self._cancel_checks = Coalescer(self._cancelled_among, name="cancel-checks")
        self._is_shut_down = False
        self._is_closed = False
        self._between_steps: StepHook | None = None
        """Tests only: awaited between the steps of a wait, to land a wake-up there."""

    @property
    def client(self) -> RedisClient:
        """The underlying client (for health checks and tests)."""
        return self._client

    async def _script(self, name: str, keys: list[str], args: list[str | int]) -> Any:
        return await self._scripts[name](keys=keys, args=args)

    # -- conversation lease ------------------------------------------------------------------

    @_translate
    async def acquire_lease(
        self, conversation_id: str, holder: str, ttl_s: float
    ) -> LeaseAcquisition:
        acquired, current = await self._script(
            "acquire_lease", [self.keys.lease(conversation_id)], [holder, to_ms(ttl_s)]
        )
        return LeaseAcquisition(bool(acquired), str(current))

    @_translate
    async def renew_lease(self, conversation_id: str, holder: str, ttl_s: float) -> bool:
        renewed = await self._script(
            "compare_and_expire", [self.keys.lease(conversation_id)], [holder, to_ms(ttl_s)]
        )
        return bool(renewed)

    @_translate
    async def release_lease(self, conversation_id: str, holder: str) -> bool:
        released = await self._script(
            "compare_and_delete", [self.keys.lease(conversation_id)], [holder]
        )
        return bool(released)

    @_translate
    async def get_lease_holder(self, conversation_id: str) -> str | None:
        return _optional_str(await self._client.get(self.keys.lease(conversation_id)))

    # -- interactive window ------------------------------------------------------------------

    async def mark_interactive(self, conversation_id: str, run_id: RunId, ttl_s: float) -> None:
        await self.change_windows([WindowChange(conversation_id, run_id, opens=True)], ttl_s)

    @_translate
    async def get_interactive_run(self, conversation_id: str) -> RunId | None:
        run_id = _optional_str(await self._client.get(self.keys.interactive(conversation_id)))
        return None if run_id is None else RunId(run_id)

    async def is_interactive(self, conversation_id: str, run_id: RunId) -> bool:
        return await self.get_interactive_run(conversation_id) == run_id

    async def clear_interactive(self, conversation_id: str, run_id: RunId) -> bool:
        close = WindowChange(conversation_id, run_id, opens=False)
        (closed,) = await self.change_windows([close], ttl_s=0.0)  # a close has no TTL
        return closed

    @_translate
    async def change_windows(self, changes: Sequence[WindowChange], ttl_s: float) -> list[bool]:
        # Every window change goes through change_window.lua, one or many (see the script).
        script, ttl_ms = self._scripts["change_window"], to_ms(ttl_s)
        calls: list[ScriptCall] = [
            (script, [self.keys.interactive(key)], ["open" if opens else "close", run_id, ttl_ms])
            for key, run_id, opens in changes
        ]
        return [bool(reply) for reply in await run_scripts(self._client, calls)]

    # -- interrupts --------------------------------------------------------------------------

    @_translate
    async def open_interrupt(self, run_id: RunId, interrupt_id: str, ttl_s: float) -> None:
        await self._script(
            "open_interrupt",
            [self.keys.interrupt(run_id, interrupt_id), self.keys.interrupt_index(run_id)],
            [interrupt_id, to_ms(ttl_s)],
        )

    @_translate
    async def resolve_interrupt(
        self, run_id: RunId, interrupt_id: str, decision: JSONObject
    ) -> bool:
        outcome, _ = await self._resolve(run_id, interrupt_id, encode_decision(decision))
        return outcome in (1, 2)

    async def _resolve(
        self, run_id: RunId, interrupt_id: str, encoded: str
    ) -> tuple[int, str | None]:
        """Run resolve_interrupt.lua: (outcome code, winning decision or None)."""
        outcome, winner = await self._script(
            "resolve_interrupt",
            [self.keys.interrupt(run_id, interrupt_id)],
            [encoded, self.keys.signal_channel(run_id), f"{SIGNAL_INTERRUPT}{interrupt_id}"],
        )
        return int(outcome), winner

    @_translate
    async def get_interrupt(self, run_id: RunId, interrupt_id: str) -> InterruptState | None:
        fields = await self._client.hgetall(self.keys.interrupt(run_id, interrupt_id))
        return _interrupt_state(fields)

    @_translate
    async def wait_interrupt(
        self, run_id: RunId, interrupt_id: str, timeout_s: float
    ) -> JSONObject | None:
        keys = [self.keys.interrupt(run_id, interrupt_id), self.keys.cancel(run_id)]
        args: list[str | int] = [
            encode_decision(CANCELLED_DECISION),
            self.keys.signal_channel(run_id),
            f"{SIGNAL_INTERRUPT}{interrupt_id}",
        ]

        async def check() -> tuple[bool, JSONObject | None]:
            found = await self._script("check_interrupt", keys, args)
            if found[0] == 2:
                return False, None
            return True, decode_decision(found[1]) if found[0] == 1 else None

        wakes_on = frozenset({f"{SIGNAL_INTERRUPT}{interrupt_id}", SIGNAL_CANCEL, SIGNAL_CLEANUP})
        return await self._wait(run_id, check, wakes_on, timeout_s, None)

    # -- cancellation ------------------------------------------------------------------------

    @_translate
    async def request_cancel(self, run_id: RunId) -> None:
        await self._script(
            "request_cancel",
            [self.keys.cancel(run_id)],
            [self._retention_ms, self.keys.signal_channel(run_id), SIGNAL_CANCEL],
        )

    @_translate
    async def is_cancelled(self, run_id: RunId) -> bool:
        # Asked at every step boundary of every run: the runs a worker claimed together ask
        # together, in one round trip for those asked while the last one was in flight.
        return await self._cancel_checks(run_id)

    async def _cancelled_among(self, run_ids: list[RunId]) -> list[bool]:
        """Each run's cancel flag, in one round trip (a pipeline: the keys' slots differ)."""
        if len(run_ids) == 1:
            return [bool(await self._client.exists(self.keys.cancel(run_ids[0])))]
        pipeline = self._client.pipeline(transaction=False)
        for run_id in run_ids:
            pipeline.exists(self.keys.cancel(run_id))
        return [bool(found) for found in await pipeline.execute()]

    @_translate
    async def wait_cancelled(self, run_id: RunId, timeout_s: float) -> bool:
        async def check() -> tuple[bool, bool]:
            cancelled = bool(await self._client.exists(self.keys.cancel(run_id)))
            return cancelled, cancelled

        return await self._wait(run_id, check, frozenset({SIGNAL_CANCEL}), timeout_s, False)

    # -- injected messages -------------------------------------------------------------------

    @_translate
    async def push_message(self, run_id: RunId, seq: int, text: str) -> None:
        length = await self._script(
            "push_message",
            [self.keys.messages(run_id)],
            [seq, text, self._retention_ms, self._max_messages],
        )
        if length < 0:
            raise queue_full(run_id, self._max_messages)

    @_translate
    async def drain_messages(self, run_id: RunId) -> list[QueuedMessage]:
        flat = await self._script("drain_all", [self.keys.messages(run_id)], [])
        # HGETALL's reply alternates field and value.
        pairs = zip(flat[::2], flat[1::2], strict=True)
        queued = [QueuedMessage(int(seq), str(text)) for seq, text in pairs]
        return sorted(queued)

    # -- live events -------------------------------------------------------------------------

    @_translate
    async def publish_events(self, run_id: RunId, events: Sequence[JSONObject]) -> None:
        if events:
            await self._client.publish(self.keys.events_channel(run_id), json.dumps(list(events)))

    @_translate
    async def subscribe_events(self, run_id: RunId) -> EventSubscription:
        if self._is_shut_down:
            ended = EventSubscription()
            ended.end()
            return ended
        backoff_s = RESUBSCRIBE_BACKOFF_S
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                while True:
                    try:
                        return await self._feeds.subscribe(run_id)
                    except (RedisConnectionError, RedisTimeoutError):
                        await asyncio.sleep(backoff_s)
                        backoff_s = min(backoff_s * 2, MAX_RESUBSCRIBE_BACKOFF_S)
        except TimeoutError as exc:
            raise BackendUnavailable(
                f"Redis did not confirm subscribing {self.keys.events_channel(run_id)}"
            ) from exc

    # -- lifecycle ---------------------------------------------------------------------------

    @_translate
    async def cleanup_run(self, run_id: RunId) -> None:
        index = self.keys.interrupt_index(run_id)
        interrupt_ids = [str(member) for member in await self._client.smembers(index)]
        doomed = [self.keys.cancel(run_id), self.keys.messages(run_id), index]
        doomed += [self.keys.interrupt(run_id, interrupt_id) for interrupt_id in interrupt_ids]
        await self._script(
            "cleanup_run", doomed, [self.keys.signal_channel(run_id), SIGNAL_CLEANUP]
        )

    async def check_available(self, timeout_s: float) -> None:
        # Bounded by the caller's time, not the client's retries: a load balancer's probe must
        # answer before its own timeout, whatever the connection pool is doing.
        try:
            async with asyncio.timeout(timeout_s):
                await self._client.ping()
        except TimeoutError:
            raise BackendUnavailable(f"redis is down: no answer within {timeout_s:g}s") from None
        except (OSError, RedisError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise BackendUnavailable(f"redis is down: {reason}") from exc

    async def shutdown(self) -> None:
        self._is_shut_down = True
        watches = tuple(self._watches)
        for watch in watches:
            watch.cancel()
        self._feeds.end_all()
        # Cancelled again until they end: a Redis call may swallow a cancel (keep_cancel).
        await cancel_and_wait(watches)
        await self._hub.close()

    async def close(self) -> None:
        await self.shutdown()
        if not self._is_closed:
            self._is_closed = True
            if self._pubsub_client is not self._client:
                await self._pubsub_client.aclose()
            await self._client.aclose()

    # -- waiting -----------------------------------------------------------------------------

    async def _wait(
        self,
        run_id: RunId,
        check: Callable[[], Awaitable[tuple[bool, T]]],
        wakes_on: frozenset[str],
        timeout_s: float,
        default: T,
    ) -> T:
        """Run a watch in its own task, so that :meth:`shutdown` can end it."""
        if self._is_shut_down:
            raise StoreShutdown("the runtime store is shutting down")
        watch = asyncio.create_task(self._watch(run_id, check, wakes_on, timeout_s, default))
        self._watches.add(watch)
        try:
            # asyncio.wait, not ``await watch``: cancelled, this task stops waiting at once and
            # makes sure the watch ends, even if a Redis call in it swallowed the first cancel.
            await asyncio.wait((watch,))
        except asyncio.CancelledError:
            await cancel_and_wait((watch,))
            raise
        finally:
            self._watches.discard(watch)
        if watch.cancelled():  # only shutdown() cancels a watch this task still waits for
            raise StoreShutdown("the runtime store is shutting down")
        return watch.result()

    async def _watch(
        self,
        run_id: RunId,
        check: Callable[[], Awaitable[tuple[bool, T]]],
        wakes_on: frozenset[str],
        timeout_s: float,
        default: T,
    ) -> T:
        """Check, then subscribe and re-check until done; a broken subscription is reopened."""
        backoff_s = RESUBSCRIBE_BACKOFF_S
        checked = False
        # The deadline is also checked in the loops, not only by asyncio.timeout's one cancel:
        # a Redis call that swallowed that cancel (Python 3.11's wait_for, see keep_cancel)
        # would otherwise leave the watch polling for ever.
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    _raise_if_past(deadline)
                    try:
                        if not checked:
                            done, value = await keep_cancel(check())
                            checked = True
                            if done:
                                return value
                        return await self._watch_channel(run_id, check, wakes_on, deadline)
                    except (RedisConnectionError, RedisTimeoutError) as exc:
                        if backoff_s == RESUBSCRIBE_BACKOFF_S:
                            logger.warning(
                                "runtime store: lost Redis while waiting (%r); trying again",
                                exc,
                                extra={"run_id": run_id},
                            )
                        await asyncio.sleep(backoff_s)
                        backoff_s = min(backoff_s * 2, MAX_RESUBSCRIBE_BACKOFF_S)
        except TimeoutError:
            pass
        # At the deadline, one last short check: the answer is then either right or a clear
        # error, never a silent "no decision" while Redis is unreachable.
        try:
            async with asyncio.timeout(min(FINAL_CHECK_TIMEOUT_S, self._poll_interval_s)):
                done, value = await keep_cancel(check())
        except (TimeoutError, RedisError) as exc:
            raise BackendUnavailable(
                f"Redis did not answer while waiting on run {run_id}: {exc!r}"
            ) from exc
        return value if done else default

    async def _watch_channel(
        self,
        run_id: RunId,
        check: Callable[[], Awaitable[tuple[bool, T]]],
        wakes_on: frozenset[str],
        deadline: float,
    ) -> T:
        """Subscribe, confirm, re-check, then re-check on every signal and poll interval.

        Raises:
            TimeoutError: ``deadline`` (loop time) passed.
        """
        channel = self.keys.signal_channel(run_id)
        loop = asyncio.get_running_loop()
        wake = _Wake(wakes_on)
        await self._step("subscribe", run_id)
        link = await self._hub.subscribe(channel, wake)
        try:
            await self._step("recheck", run_id)
            done, value = await keep_cancel(check())
            if done:
                return value
            await self._step("wait", run_id)
            while True:
                _raise_if_past(deadline)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self._poll_interval_s, deadline - loop.time())):
                        await wake.event.wait()
                if wake.is_broken:
                    raise RedisConnectionError("the Pub/Sub connection broke while waiting")
                # Cleared before the check: a signal that lands during it is not lost.
                wake.event.clear()
                done, value = await keep_cancel(check())
                if done:
                    return value
        finally:
            await self._hub.unsubscribe(link, channel, wake)

    async def _step(self, step: str, run_id: RunId) -> None:
        if self._between_steps is not None:
            await self._between_steps(step, run_id)


def _raise_if_past(deadline: float) -> None:
    if asyncio.get_running_loop().time() >= deadline:
        raise TimeoutError


def _optional_str(value: bytes | str | None) -> str | None:
    # The client decodes responses; the union comes from redis-py's annotations.
    return value.decode() if isinstance(value, bytes) else value


def _interrupt_state(fields: Mapping[Any, Any]) -> InterruptState | None:
    if not fields:
        return None
    if fields.get("status") == InterruptStatus.RESOLVED:
        return InterruptState(
            status=InterruptStatus.RESOLVED, decision=decode_decision(str(fields["decision"]))
        )
    return InterruptState(status=InterruptStatus.PENDING, decision=None)
