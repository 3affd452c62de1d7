"""Schedule timing, computed only (no waiting): cron in a time zone across daylight-saving
transitions as cronsim documents them (Debian cron's rules), the interval form, catch-up."""

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from moorline.dispatch.cron import CatchUp, due_ticks, parse_cadence
from moorline.errors import InvalidRequest

BERLIN = ZoneInfo("Europe/Berlin")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def ticks(expression: str, after: datetime, count: int) -> list[datetime]:
    cadence = parse_cadence(expression, None, "Europe/Berlin")
    found, tick = [], after
    for _ in range(count):
        tick = cadence.next_after(tick)
        found.append(tick)
    return found


def test_a_daily_job_in_the_skipped_hour_runs_at_the_end_of_the_gap() -> None:
    # 2026-03-29: Berlin's clocks jump from 02:00 CET to 03:00 CEST; 02:30 does not exist.
    found = ticks("30 2 * * *", utc(2026, 3, 28, 12), 3)
    assert [t.astimezone(BERLIN).isoformat() for t in found] == [
        "2026-03-29T03:00:00+02:00",  # run at once after the gap (Debian cron)
        "2026-03-30T02:30:00+02:00",
        "2026-03-31T02:30:00+02:00",
    ]


def test_a_daily_job_in_the_repeated_hour_runs_once() -> None:
    # 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 happens twice.
    found = ticks("30 2 * * *", utc(2026, 10, 24, 12), 2)
    assert found == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]


def test_a_frequent_job_follows_the_wall_clock_through_both_transitions() -> None:
    spring = ticks("*/30 * * * *", utc(2026, 3, 29, 0, 10), 3)
    assert spring == [utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 0), utc(2026, 3, 29, 1, 30)]
    # In autumn 02:00 and 02:30 come twice, an hour apart in UTC: four ticks in two hours.
    autumn = ticks("*/30 * * * *", utc(2026, 10, 24, 23, 50), 5)
    assert autumn == [
        utc(2026, 10, 25, 0, 0),
        utc(2026, 10, 25, 0, 30),
        utc(2026, 10, 25, 1, 0),
        utc(2026, 10, 25, 1, 30),
        utc(2026, 10, 25, 2, 0),
    ]
    # Starting inside the second (CET) 02:xx, as a scheduler resuming from a stored UTC
    # next_at does, the first 02:xx is not repeated.
    assert ticks("*/30 * * * *", utc(2026, 10, 25, 1, 0), 1) == [utc(2026, 10, 25, 1, 30)]


def test_the_previous_tick_and_the_interval_form() -> None:
    cadence = parse_cadence("0 9 * * MON", None, "Europe/Berlin")
    assert cadence.last_at_or_before(utc(2026, 11, 25)) == utc(2026, 11, 23, 8)
    assert cadence.last_at_or_before(utc(2026, 11, 23, 8)) == utc(2026, 11, 23, 8)
    every = parse_cadence(None, 10, None)
    assert every.next_after(utc(2026, 1, 1, 0, 0, 3)) == utc(2026, 1, 1, 0, 0, 10)
    assert every.next_after(utc(2026, 1, 1, 0, 0, 10)) == utc(2026, 1, 1, 0, 0, 20)
    assert every.last_at_or_before(utc(2026, 1, 1, 0, 0, 19)) == utc(2026, 1, 1, 0, 0, 10)


@pytest.mark.parametrize(
    ("cron", "every", "zone", "says"),
    [
        ("* * * *", None, None, "5 fields"),
        ("*/15 * * * * *", None, None, "5 fields"),
        ("61 * * * *", None, None, "not valid"),
        ("* * 31 2 *", None, None, "not valid"),
        (None, 0, None, "every_seconds"),
        ("* * * * *", 5, None, "exactly one"),
        (None, None, None, "exactly one"),
        ("* * * * *", None, "Mars/Olympus", "time zone"),
        ("* * * * *", None, "../../etc/passwd", "time zone"),
    ],
)
def test_bad_cadences_are_refused_with_a_sentence(
    cron: str | None, every: int | None, zone: str | None, says: str
) -> None:
    with pytest.raises(InvalidRequest, match=says):
        parse_cadence(cron, every, zone)


def test_due_ticks_fire_late_ones_within_the_grace_and_catch_up_as_told() -> None:
    every = parse_cadence(None, 60, None)
    now = utc(2026, 1, 1, 12, 0, 30)
    # Three ticks late by less than the grace (a leader's failover): all fire.
    fired, following = due_ticks(
        every, utc(2026, 1, 1, 11, 58), now, grace_s=300, catch_up=CatchUp.SKIP, limit=100
    )
    assert fired == [utc(2026, 1, 1, 11, 58), utc(2026, 1, 1, 11, 59), utc(2026, 1, 1, 12)]
    assert following == utc(2026, 1, 1, 12, 1)
    # Down for an hour: skip fires only the ticks within the grace; one adds the latest missed.
    hour_ago = utc(2026, 1, 1, 11)
    skipped, after_skip = due_ticks(
        every, hour_ago, now, grace_s=100, catch_up=CatchUp.SKIP, limit=100
    )
    assert skipped == [utc(2026, 1, 1, 11, 59), utc(2026, 1, 1, 12)]
    one, after_one = due_ticks(every, hour_ago, now, grace_s=100, catch_up=CatchUp.ONE, limit=100)
    assert one == [utc(2026, 1, 1, 11, 58), *skipped]
    assert after_skip == after_one == utc(2026, 1, 1, 12, 1)
    # Nothing due yet, and a limit leaves the rest for the next pass.
    assert due_ticks(
        every, utc(2026, 1, 1, 12, 1), now, grace_s=90, catch_up=CatchUp.ONE, limit=5
    ) == (
        [],
        utc(2026, 1, 1, 12, 1),
    )
    first, rest = due_ticks(
        every, utc(2026, 1, 1, 11, 58), now, grace_s=300, catch_up=CatchUp.SKIP, limit=1
    )
    assert (first, rest) == ([utc(2026, 1, 1, 11, 58)], utc(2026, 1, 1, 11, 59))
