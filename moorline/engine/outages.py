"""Saying a runtime store outage once, however many calls it fails.

While the runtime store (Redis) cannot be reached, a worker's calls to it fail again and
again: every heartbeat's renewal, for every attempt it holds; every attempt's cancel watcher,
once a second. Logged each as a warning, a five-minute outage with a hundred runs in flight
was tens of thousands of lines that all said the same. An :class:`OutageLog` says the first
failure of an outage as a warning and the rest at debug level; the outage ends when a call
succeeds (:meth:`OutageLog.answered`, with an info line) or, for callers that cannot tell
when the store answers again, when no call has failed for ``quiet_s``.
"""

import logging
import time
from collections.abc import Callable, Mapping

QUIET_S = 60.0
"""Failures further apart than this belong to separate outages."""


class OutageLog:
    """One worker's log of the failures of one kind of store call.

    Args:
        logger: Where the lines go.
        what: What fails, for the line that says it answers again ("runtime store
            bookkeeping").
        quiet_s: A failure this long after the last one starts a new outage.
        clock: Seconds, monotonic.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        quiet_s: float = QUIET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._clock = clock
        self._what = what
        self._quiet_s = quiet_s
        self._since: float | None = None
        self._last = 0.0

    def failed(self, message: str, *args: object, extra: Mapping[str, object]) -> None:
        """Log a failed call: a warning if it is the first of an outage, else debug."""
        now = self._clock()
        if self._since is None or now - self._last > self._quiet_s:
            self._since = now
            self._logger.warning(
                message + " (more such failures at debug level until it answers)",
                *args,
                extra=extra,
            )
        else:
            self._logger.debug(message, *args, extra=extra)
        self._last = now

    def answered(self) -> None:
        """A call succeeded: the outage, if there was one, is over (an info line says so)."""
        if self._since is None:
            return
        self._logger.info(
            "%s answers again after failing for %.1f s",
            self._what,
            self._clock() - self._since,
        )
        self._since = None
