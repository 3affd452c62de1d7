"""The UTC days of the daily counters: run quotas (admission) and model budgets.

One day name, one reset and one Redis expiry for both, so a tenant's quota and budget always
turn over together, at 00:00 UTC by the clock of the process that counts.
"""

import math
from datetime import UTC, date, datetime, time, timedelta

DAY_FORMAT = "%Y-%m-%d"

COUNTER_MARGIN_S = 3600.0
"""Seconds a Redis counter outlives its day: processes whose clocks disagree by less than this
around midnight still find the day's counter instead of starting a fresh one."""


def quota_day(now: datetime) -> str:
    """The UTC day ``now`` falls on, as the counters name it (``YYYY-MM-DD``)."""
    return now.astimezone(UTC).strftime(DAY_FORMAT)


def next_reset(now: datetime) -> datetime:
    """The next 00:00 UTC after ``now``: when the day's quota and budget start again."""
    today = now.astimezone(UTC).date()
    return datetime.combine(today + timedelta(days=1), time(0), tzinfo=UTC)


def seconds_until(now: datetime, then: datetime) -> int:
    """Whole seconds from ``now`` until ``then``, rounded up and at least 1 (``Retry-After``)."""
    return max(1, math.ceil((then - now).total_seconds()))


def counter_ttl_ms(day: str, now: datetime) -> int:
    """Milliseconds a Redis counter of ``day`` lives from ``now`` (at least 1).

    To the day's end plus :data:`COUNTER_MARGIN_S`.
    """
    start = datetime.combine(date.fromisoformat(day), time(0), tzinfo=UTC)
    ends_at = start + timedelta(days=1, seconds=COUNTER_MARGIN_S)
    return max(1, math.ceil((ends_at - now).total_seconds() * 1000))
