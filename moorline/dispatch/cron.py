"""When a schedule's ticks fall: a cron expression in a time zone, or a fixed interval.

Pure functions over values (no I/O), used by the API to check a schedule and compute its first
tick, and by the scheduler (:mod:`moorline.admission.scheduler`) to find the ticks that are due.

- **Cron**: five fields (minute, hour, day of month, month, day of week), evaluated by
  `cronsim <https://github.com/cuu508/cronsim>`_ in the schedule's IANA time zone
  (``zoneinfo``). cronsim follows Debian's cron, daylight-saving transitions included, and
  so do schedules: a job at a fixed time (or with a granularity over one hour) whose time falls
  in the hour skipped in spring runs at the end of the gap (``30 2 * * *`` in Europe/Berlin
  runs at 03:00 CEST on the last Sunday of March), and in autumn such a job runs once, in the
  first of the two repeated hours; jobs that run more often (``*/30 * * * *``) follow the wall
  clock, so they run in both repeated hours and not in the skipped one. A sixth (seconds)
  field is refused: sub-minute cadences take the interval form.
- **Interval** (``every_seconds``): ticks at the multiples of the interval since the Unix epoch,
  in UTC, so every process computes the same instants and a tick's time names it for good.

Ticks are aware UTC datetimes with whole seconds.
"""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from moorline.errors import InvalidRequest

CRON_FIELDS = 5
MAX_EVERY_SECONDS = 366 * 24 * 3600
"""The longest interval: a year (longer cadences are cron's)."""


class CatchUp(StrEnum):
    """What a schedule does with ticks missed by more than the grace period.

    A tick is *missed* when no scheduler fired it within ``MOORLINE_SCHEDULE_GRACE`` seconds
    of its time (every process was down, or the schedule's tenant had no scheduler running);
    ticks merely late by a leader's failover are fired as usual.
    """

    SKIP = "skip"
    """Missed ticks fire nothing; the schedule goes on from the next tick."""
    ONE = "one"
    """The latest missed tick fires once, however many were missed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cadence:
    """A schedule's timing: exactly one of ``cron`` and ``every_s`` is set.

    Attributes:
        cron: A five-field cron expression, read in ``timezone``.
        every_s: An interval in seconds (ticks at the epoch's multiples of it, UTC).
        timezone: The IANA time zone of ``cron`` (ignored by an interval).
    """

    cron: str | None = None
    every_s: int | None = None
    timezone: str = "UTC"

    def next_after(self, when: datetime) -> datetime:
        """The first tick strictly after ``when`` (aware)."""
        if self.every_s is not None:
            seconds = int(when.timestamp()) // self.every_s * self.every_s + self.every_s
            return datetime.fromtimestamp(seconds, UTC)
        return _utc(next(self._iterate(when, reverse=False)))

    def last_at_or_before(self, when: datetime) -> datetime:
        """The last tick at or before ``when`` (aware)."""
        if self.every_s is not None:
            seconds = int(when.timestamp()) // self.every_s * self.every_s
            return datetime.fromtimestamp(seconds, UTC)
        # cronsim's reverse iteration is strict too, so start a second after.
        start = when.replace(microsecond=0) + timedelta(seconds=1)
        return _utc(next(self._iterate(start, reverse=True)))

    def ticks(self, after: datetime) -> Iterator[datetime]:
        """The ticks strictly after ``after``, in order (endless)."""
        tick = self.next_after(after)
        while True:
            yield tick
            tick = self.next_after(tick)

    def _iterate(self, when: datetime, *, reverse: bool) -> Iterator[datetime]:
        assert self.cron is not None
        local = when.astimezone(ZoneInfo(self.timezone))
        return iter(CronSim(self.cron, local, reverse=reverse))


def parse_cadence(cron: str | None, every_s: int | None, timezone: str | None) -> Cadence:
    """A checked cadence from a request's fields.

    Raises:
        InvalidRequest: both or neither of ``cron`` and ``every_s``, a cron expression that
            is not five valid fields, an interval out of range, or an unknown time zone.
    """
    zone = timezone or "UTC"
    if (cron is None) == (every_s is None):
        raise InvalidRequest("a schedule needs exactly one of 'cron' and 'every_seconds'")
    try:
        # zoneinfo refuses keys that are not normalised relative paths (ValueError), so a
        # name cannot reach outside the time zone database.
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest(
            f"unknown time zone {zone!r}; use an IANA name like Europe/Berlin"
        ) from None
    if every_s is not None:
        if not 1 <= every_s <= MAX_EVERY_SECONDS:
            raise InvalidRequest(f"every_seconds must be from 1 to {MAX_EVERY_SECONDS}")
        return Cadence(every_s=every_s, timezone=zone)
    assert cron is not None
    expression = " ".join(cron.split())
    if len(expression.split(" ")) != CRON_FIELDS:
        raise InvalidRequest(
            f"cron {cron!r} must have 5 fields (minute hour day month weekday); "
            "for seconds use every_seconds"
        )
    try:
        cadence = Cadence(cron=expression, timezone=zone)
        cadence.next_after(datetime.now(UTC))
    except (CronSimError, StopIteration) as exc:
        raise InvalidRequest(f"cron {cron!r} is not valid: {exc or 'it never fires'}") from None
    return cadence


def due_ticks(
    cadence: Cadence,
    next_at: datetime,
    now: datetime,
    *,
    grace_s: float,
    catch_up: CatchUp,
    limit: int,
) -> tuple[list[datetime], datetime]:
    """The ticks to fire now, and the schedule's next tick after them.

    Args:
        cadence: The schedule's timing.
        next_at: The schedule's first unfired tick.
        now: The scheduler's time.
        grace_s: Ticks older than this are missed (see :class:`CatchUp`).
        catch_up: What to do with missed ticks.
        limit: At most this many ticks on time are returned; the rest wait for the next pass.

    Returns:
        The ticks to fire, oldest first (a missed one first under :attr:`CatchUp.ONE`), and
        the tick after the last one looked at (the schedule's new ``next_at``).
    """
    cutoff = now - timedelta(seconds=grace_s)
    fire: list[datetime] = []
    first = next_at
    if next_at < cutoff:
        if catch_up is CatchUp.ONE:
            fire.append(cadence.last_at_or_before(cutoff))
        first = cadence.next_after(cutoff)
    on_time = list(
        itertools.islice(itertools.takewhile(lambda t: t <= now, _from(cadence, first)), limit)
    )
    fire.extend(on_time)
    following = cadence.next_after(on_time[-1]) if on_time else first
    return fire, following


def _from(cadence: Cadence, first: datetime) -> Iterator[datetime]:
    yield first
    yield from cadence.ticks(first)


def _utc(when: datetime) -> datetime:
    return when.astimezone(UTC)
