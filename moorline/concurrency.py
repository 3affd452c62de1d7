"""Concurrency utilities for one asyncio event loop per process (seed 002).

Moorline's code runs on a single event loop: between two ``await`` points nothing else runs, so
plain dictionaries need no locks. What remains to coordinate is what spans an ``await``, and the
few places where blocking code must run beside the loop. Each tool here covers one of them:

- :class:`KeyedLock`: one :class:`asyncio.Lock` per key, created on first use and dropped as
  soon as nobody holds or waits for it, so serialising per run or per conversation never
  degenerates into one global lock and the map never outgrows the keys in use.
- :class:`BoundedQueue`: an :class:`asyncio.Queue` that must have a bound, and can be emptied
  at once (:meth:`BoundedQueue.drain_nowait`), which wakes every producer waiting for room.
- :class:`ThreadBridge` and :func:`run_in_thread`: blocking code (a sync SDK's iterator, a sync
  step function, file I/O) runs in a producer thread of its own and hands its items to the loop
  through a bounded queue. The thread never touches the loop's state: it only puts into the
  queue, through the loop. The consumer stops it with a :class:`threading.Event` and drains the
  queue as it leaves, so a producer blocked on a full queue is always released.
- :func:`keep_cancel` and :func:`cancel_and_wait`: await a call from a library that may swallow
  a cancellation (redis-py on Python 3.11) and raise it anyway; cancel tasks and wait for their
  end, cancelling again any that swallowed it.
- :class:`TTLCache`: values loaded by an async function and trusted for a TTL, one load per key
  at a time; see the class for what is served while a reload runs or after one failed.
- :func:`settle`: answer a waiter's future with a result or an error, unless it stopped
  waiting (the group writers' way to hand each caller its own answer).
- :func:`is_set_within`: wait for an event, at most so long: the pause of every loop that runs
  each interval until it is stopped.

Nothing here is thread-safe except where a class says so: use each from its event loop.

Seed 002 also has a reader-writer lock and a "drained" event; Moorline has no use for either
(docs/design.md, "Concurrency model"), so they are not here.
"""

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Generic, ParamSpec, Self, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

RECANCEL_EVERY_S: Final = 0.5
"""How long :func:`cancel_and_wait` lets a cancelled task run before cancelling it again."""
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
P = ParamSpec("P")

DEFAULT_BRIDGE_QUEUE = 64
"""Items a bridge's producer thread may run ahead of its consumer."""

DEFAULT_CACHE_ENTRIES = 1024
"""Keys a :class:`TTLCache` keeps before it evicts the least recently loaded one."""


# --- per-key locks ---------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _KeyEntry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    """Tasks holding or waiting for the lock."""


class KeyedLock(Generic[K]):
    """Mutual exclusion per key: tasks using the same key take turns, other keys run freely.

    A key's lock exists only while some task holds or waits for it; the last one out removes
    it, so a map keyed by run or conversation ids stays as small as the work in flight. Waiters
    of one key are served first come, first served (:class:`asyncio.Lock` is fair). Not
    reentrant: a task holding a key that asks for it again waits forever.

    Usage::

        locks: KeyedLock[str] = KeyedLock()
        async with locks.hold(run_id):
            ...
    """

    def __init__(self) -> None:
        self._entries: dict[K, _KeyEntry] = {}

    @asynccontextmanager
    async def hold(self, key: K) -> AsyncIterator[None]:
        """Hold ``key``'s lock for the ``async with`` block, waiting for it when taken."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _KeyEntry()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            # Runs for a holder and for a waiter that was cancelled alike.
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]

    def locked(self, key: K) -> bool:
        """Whether some task holds ``key`` now."""
        entry = self._entries.get(key)
        return entry is not None and entry.lock.locked()

    def __len__(self) -> int:
        """Keys held or waited for now (the locks that exist)."""
        return len(self._entries)


# --- bounded queue ---------------------------------------------------------------------------


class BoundedQueue(asyncio.Queue[T]):
    """An :class:`asyncio.Queue` with a mandatory bound.

    When full, :meth:`put` waits for room (backpressure on the producer) and ``put_nowait``
    raises :class:`asyncio.QueueFull`; the owner decides which of the two a producer gets and
    says so. :meth:`drain_nowait` empties it at once, for a consumer that leaves.

    Args:
        maxsize: Most items queued at once; at least 1 (``asyncio.Queue`` reads 0 as
            unbounded).

    Raises:
        ValueError: ``maxsize`` is below 1.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"a bounded queue needs a maxsize of at least 1, got {maxsize}")
        super().__init__(maxsize)

    def drain_nowait(self) -> list[T]:
        """Take every queued item at once, oldest first, and wake producers waiting for room."""
        items: list[T] = []
        while not self.empty():
            items.append(self.get_nowait())
        return items


# --- thread bridge ---------------------------------------------------------------------------


class _End:
    """The producer's last item: the source is exhausted."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """The producer's last item: the source raised ``error``."""

    error: BaseException


_END: Final = _End()


class ThreadBridge(Generic[T]):
    """Iterate a blocking iterable from async code, its items made in a thread of its own.

    ``async with`` starts a producer thread that iterates ``source`` and hands each item to the
    loop (``call_soon_threadsafe``), which puts it into a :class:`BoundedQueue`. The producer
    takes one of ``max_queued`` slots (a :class:`threading.Semaphore`) per item and the consumer
    gives it back when it takes the item, so the producer runs ahead by at most ``max_queued``
    items and blocks while they wait. It never waits on the loop itself: one cross-thread
    callback per item, without a task or a round trip, which keeps a bridge at about 10⁵ items
    a second.

    Leaving the ``async with`` block (exhausted, ``break``, an error, or the consumer's
    cancellation) sets the stop event, drains the queue and gives the producer room: a producer
    blocked on a full queue wakes, sees the stop before its next item and ends. A producer
    blocked inside ``source`` itself cannot be interrupted; it ends when that call returns. It
    closes the iterator in its own thread, so a generator's ``finally`` runs there.

    An exception raised by ``source`` is re-raised by the consumer after the items produced
    before it. The thread runs in a copy of the consumer's context variables. It is a daemon
    thread of its own rather than one of the loop's default executor, which is small (CPU count
    + 4 threads) and shared with the loop's own blocking calls (``getaddrinfo`` for every new
    database or Redis connection): slow sync code neither queues behind other slow sync code
    nor starves those.

    Usage::

        async with ThreadBridge(sdk.stream(prompt)) as chunks:
            async for chunk in chunks:
                ...

    Args:
        source: The blocking iterable; ``iter(source)`` is called in the producer thread.
        max_queued: Items the producer may run ahead of the consumer; at least 1.
        name: The producer thread's name.

    Raises:
        ValueError: ``max_queued`` is below 1.
    """

    def __init__(
        self,
        source: Iterable[T],
        *,
        max_queued: int = DEFAULT_BRIDGE_QUEUE,
        name: str = "moorline-bridge",
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"a bridge needs max_queued of at least 1, got {max_queued}")
        self._source = source
        # One place more than there are slots: the last marker needs none.
        self._queue: BoundedQueue[T | _End | _Failure] = BoundedQueue(max_queued + 1)
        self._room = threading.Semaphore(max_queued)
        self._name = name
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finished = False

    async def __aenter__(self) -> Self:
        if self._loop is not None:
            raise RuntimeError("a ThreadBridge can be entered only once")
        self._loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        threading.Thread(
            target=context.run, args=(self._produce,), name=self._name, daemon=True
        ).start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the producer, drain the queue and give the producer room (idempotent)."""
        if self._stop.is_set():
            return
        self._finished = True
        self._stop.set()
        drained = self._queue.drain_nowait()
        # The drained items' slots, and one more: the producer may be waiting for a slot held
        # by an item still on its way to the queue, which the drain could not take.
        self._room.release(len(drained) + 1)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        if self._loop is None:
            raise RuntimeError("iterate a ThreadBridge inside 'async with'")
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, _End):
            self._finished = True
            raise StopAsyncIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        self._room.release()
        return item

    # The producer thread: everything below runs there.

    def _produce(self) -> None:
        iterator: Iterator[T] | None = None
        last: _End | _Failure = _END
        try:
            iterator = iter(self._source)
            for item in iterator:
                if not self._wait_for_room() or not self._send(item):
                    return
        except BaseException as exc:  # crosses to the consumer, whatever it is
            last = _Failure(exc)
        finally:
            if iterator is not None:
                self._close_iterator(iterator)
        if not self._stop.is_set():
            self._send(last)

    def _wait_for_room(self) -> bool:
        """Take a slot, blocking while the queue is full; False: stop now.

        The consumer's :meth:`close` releases a slot after setting the stop, so this always
        wakes up for a stop.
        """
        self._room.acquire()
        return not self._stop.is_set()

    def _send(self, item: T | _End | _Failure) -> bool:
        """Queue ``item`` on the loop (there is room for it); False when the loop is closed."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    @staticmethod
    def _close_iterator(iterator: Iterator[T]) -> None:
        close = getattr(iterator, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:
            logger.exception("closing a bridged iterator failed")


async def run_in_thread(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Call the blocking ``fn(*args, **kwargs)`` in a thread of its own and return its result.

    The call is a one-item :class:`ThreadBridge`: it gets the bridge's own thread (not the
    loop's small default executor), a copy of the caller's context variables, and its exception
    re-raised here. Cancelling the caller returns at once; a call already running cannot be
    interrupted, so it finishes in its thread and its result is dropped.
    """

    def call() -> Iterator[T]:
        yield fn(*args, **kwargs)

    async with ThreadBridge(call(), max_queued=1, name=f"moorline-call-{_name_of(fn)}") as results:
        async for result in results:
            return result
    raise AssertionError("unreachable: the bridge ended without a result")  # pragma: no cover


async def cancel_and_wait(
    tasks: Iterable["asyncio.Task[Any]"], *, recancel_every_s: float = RECANCEL_EVERY_S
) -> None:
    """Cancel ``tasks`` and wait until every one has ended.

    A task that outlives its cancel for ``recancel_every_s`` is cancelled again: a library
    may swallow a cancellation (see :func:`keep_cancel`), and a plain ``cancel(); await`` then
    waits for as long as the task would have run, possibly for ever. If the caller is
    cancelled meanwhile, it stops waiting at once (the tasks stay cancelled).
    """
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=recancel_every_s)
        for task in pending:
            task.cancel()


def settle(future: "asyncio.Future[T]", outcome: "T | BaseException") -> None:
    """Set ``future``'s result, or its exception if ``outcome`` is one, unless it is done.

    A done future's waiter stopped waiting (it was cancelled): nothing is owed to it. For
    futures whose results are never exceptions.
    """
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


async def is_set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout_s`` seconds; whether it was set.

    ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` can swallow a cancel.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def keep_cancel(call: Awaitable[T]) -> T:
    """Await a Redis call; raise the cancellation it swallowed, if it swallowed one.

    redis-py sends with ``asyncio.wait_for`` when a socket timeout is set (its default is 5 s).
    On Python 3.11, ``wait_for`` returns the result instead of raising when the cancel lands as
    the send completes (CPython gh-86296, fixed in 3.12). The task's ``cancelling()`` count
    still records the request, so a call that returns with a higher count than it started with
    lost one: raise it here. Without this, a watcher cancelled at that moment never ends.
    """
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    result = await call
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__qualname__)


# --- TTL cache -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Cached(Generic[V]):
    value: V
    fresh_until: float
    loaded_at: float


class TTLCache(Generic[K, V]):
    """Values from an async loader, trusted for ``ttl_s`` seconds after each load.

    - **Fresh** (loaded less than ``ttl_s`` ago): returned as is.
    - **Missing**: the caller loads it; callers asking for the same key meanwhile wait for that
      load and then use its result (one load per key at a time, through a :class:`KeyedLock`).
      A failed load raises in the caller that made it, and nothing is cached.
    - **Stale**: the first caller reloads it and gets the new value. Callers arriving while that
      reload runs get the stale value at once: nobody queues behind a slow source, and the
      source sees one load however many callers there are.
    - **Reload failed**: the error is logged and the stale value is served and trusted for
      another ``ttl_s`` (stale-if-error), so a broken source costs one attempt per TTL instead
      of one per call, and what worked last keeps working.

    At most ``max_entries`` keys are kept; beyond that the least recently loaded is evicted.
    Meant for configuration-sized data read often and changing rarely (the plans file).

    Args:
        load: Loads the value of a key; it may raise.
        ttl_s: Seconds a loaded value is trusted.
        name: Names the cache in log messages.
        max_entries: Keys kept at most.
        clock: Monotonic clock in seconds, replaceable in tests.

    Raises:
        ValueError: ``ttl_s`` is not positive or ``max_entries`` is below 1.
    """

    def __init__(
        self,
        load: Callable[[K], Awaitable[V]],
        *,
        ttl_s: float,
        name: str = "cache",
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s must be positive and max_entries at least 1")
        self._load = load
        self._ttl_s = ttl_s
        self._name = name
        self._max_entries = max_entries
        self._clock = clock
        self._entries: dict[K, _Cached[V]] = {}
        self._loading: KeyedLock[K] = KeyedLock()

    async def get(self, key: K) -> V:
        """The value of ``key``: cached when fresh, else loaded (see the class for the rules).

        Raises:
            Exception: Whatever the loader raised, when there was no value to fall back on.
        """
        entry = self._entries.get(key)
        if entry is not None and (self._clock() < entry.fresh_until or self._loading.locked(key)):
            return entry.value
        async with self._loading.hold(key):
            entry = self._entries.get(key)
            if entry is not None and self._clock() < entry.fresh_until:
                return entry.value  # loaded by the caller we waited for
            try:
                value = await self._load(key)
            except Exception as exc:
                if entry is None:
                    raise
                now = self._clock()
                logger.error(
                    "%s: reloading %r failed, keeping the value loaded %.1fs ago: %s",
                    self._name,
                    key,
                    now - entry.loaded_at,
                    exc,
                )
                entry.fresh_until = now + self._ttl_s
                return entry.value
            self.put(key, value)
            return value

    def put(self, key: K, value: V) -> None:
        """Store ``value`` for ``key`` as freshly loaded (e.g. a first load made at start)."""
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = _Cached(value, now + self._ttl_s, now)
        if len(self._entries) > self._max_entries:
            del self._entries[next(iter(self._entries))]

    def invalidate(self, key: K) -> None:
        """Forget ``key``: the next :meth:`get` loads it (a load running now is not stopped)."""
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
