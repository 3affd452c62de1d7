"""Lanes a worker serves and its slots in each: ``--lanes lane=slots,...`` and the defaults.

Each lane has its own slots, so a flooded sandbox lane can never take a professional slot.
"""

import re
from collections.abc import Mapping, Set

from moorline.errors import ConfigError

MAX_SLOTS = 10_000
_LANE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def parse_lanes(spec: str, *, known: Set[str] | None = None) -> dict[str, int]:
    """Parse ``"workflow_professional=8,workflow_team=4"`` into ``{lane: slots}``.

    Args:
        spec: Comma-separated ``lane=slots`` pairs; spaces around parts are ignored.
        known: The lanes the plans route to; a lane outside it is refused, since a worker
            waiting on a lane no run is ever enqueued on is a typo, not a choice.

    Raises:
        ConfigError: one line naming the bad part and why.
    """
    lanes: dict[str, int] = {}
    parts = [part.strip() for part in spec.split(",")]
    if not any(parts):
        raise ConfigError("--lanes: empty; expected lane=slots[,lane=slots...]")
    for part in parts:
        if not part:
            raise ConfigError(f"--lanes: empty entry in {spec!r}")
        name, sep, count = (piece.strip() for piece in part.partition("="))
        if not sep:
            raise ConfigError(f"--lanes: {part!r} is not lane=slots")
        if not _LANE_NAME.match(name):
            raise ConfigError(f"--lanes: lane name {name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if name in lanes:
            raise ConfigError(f"--lanes: lane {name!r} is given twice")
        if known is not None and name not in known:
            raise ConfigError(
                f"--lanes: unknown lane {name!r} (known lanes: {', '.join(sorted(known))})"
            )
        if not count.isdigit() or not 1 <= int(count) <= MAX_SLOTS:
            raise ConfigError(
                f"--lanes: slots of {name!r} must be a whole number from 1 to {MAX_SLOTS}, "
                f"got {count!r}"
            )
        lanes[name] = int(count)
    return lanes


def resolve_lanes(spec: str | None, defaults: Mapping[str, int]) -> dict[str, int]:
    """The lanes a worker serves and their slots.

    ``spec`` when given (its lanes checked against ``defaults``), else ``defaults`` (see
    :func:`moorline.plans.default_lane_slots`).

    Raises:
        ConfigError: ``spec`` is malformed or names a lane no plan routes to.
    """
    if spec is None or not spec.strip():
        return dict(defaults)
    return parse_lanes(spec, known=set(defaults))
