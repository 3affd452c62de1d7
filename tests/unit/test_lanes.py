"""``--lanes lane=slots,...``: parsing, defaults, and one-line errors naming the bad part."""

import pytest

from moorline.dispatch.lanes import parse_lanes, resolve_lanes
from moorline.errors import ConfigError
from moorline.plans import DEFAULT_PLANS, default_lane_slots

DEFAULTS = default_lane_slots(DEFAULT_PLANS)


def test_parse() -> None:
    assert parse_lanes("workflow_professional=8, workflow_team = 2") == {
        "workflow_professional": 8,
        "workflow_team": 2,
    }


def test_resolve_defaults_when_absent() -> None:
    assert resolve_lanes(None, DEFAULTS) == DEFAULTS
    assert resolve_lanes("  ", DEFAULTS) == DEFAULTS
    assert resolve_lanes("workflow_sandbox=5", DEFAULTS) == {"workflow_sandbox": 5}


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("", "empty"),
        ("workflow_team", "'workflow_team' is not lane=slots"),
        ("workflow_team=", "slots of 'workflow_team'"),
        ("workflow_team=0", "slots of 'workflow_team'"),
        ("workflow_team=-1", "slots of 'workflow_team'"),
        ("workflow_team=two", "'two'"),
        ("workflow_team=1,,workflow_sandbox=1", "empty entry"),
        ("workflow_team=1,workflow_team=2", "given twice"),
        ("=3", "lane name ''"),
        ("bad lane=3", "lane name 'bad lane'"),
    ],
)
def test_bad_specs(spec: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_lanes(spec)
    assert named in caught.value.message
    assert caught.value.message.startswith("--lanes")


def test_unknown_lane_lists_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown lane 'workflow_gold'.*workflow_professional"):
        resolve_lanes("workflow_gold=2", DEFAULTS)
