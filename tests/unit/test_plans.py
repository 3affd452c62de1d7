"""Plans: docs/design.md's defaults, the community edition, the plans file and its TTL cache."""

from pathlib import Path

import pytest

from moorline.errors import ConfigError
from moorline.plans import (
    COMMUNITY_LANE,
    DEFAULT_PLANS,
    Plan,
    PlansProvider,
    default_lane_slots,
    load_plans_file,
    parse_rate_limit,
    resolve_plans,
    tenant_caps,
)
from moorline.settings import Edition, Settings, load_settings, unknown_variables
from tests.helpers import FakeClock

TEAM_OVERRIDE = """
plans:
  team:
    lane: workflow_team
    priority: 60
    daily_quota: 800
    rate_limit: "15/second"
    tenant_concurrency: 5
    lane_slots: 6
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plans.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_follow_design_table() -> None:
    rows = {
        (
            p.name,
            p.lane,
            p.priority,
            p.daily_quota,
            p.rate_limit,
            p.tenant_concurrency,
            p.lane_slots,
        )
        for p in DEFAULT_PLANS.values()
    }
    assert rows == {
        ("professional", "workflow_professional", 100, 1000, "20/second", 8, 8),
        ("team", "workflow_team", 50, 500, "10/second", 4, 4),
        ("sandbox", "workflow_sandbox", 10, 50, "2/second", 2, 2),
    }


def test_cloud_lane_slots_are_one_above_each_plans_cap() -> None:
    plans = resolve_plans(Settings())
    # 8/4/2 of the plans' lane_slots, raised to one above each plan's tenant cap.
    assert default_lane_slots(plans) == {
        "workflow_professional": 9,
        "workflow_team": 5,
        "workflow_sandbox": 3,
    }
    assert tenant_caps(plans) == {"professional": 8, "team": 4, "sandbox": 2}


def test_community_edition_routes_every_plan_to_one_lane() -> None:
    plans = resolve_plans(Settings(edition=Edition.COMMUNITY))
    assert {plan.lane for plan in plans.values()} == {COMMUNITY_LANE}
    # Priorities and caps still differ per plan inside the one lane.
    assert plans["professional"].priority > plans["sandbox"].priority
    assert default_lane_slots(plans) == {COMMUNITY_LANE: 14}


def test_file_plan_replaces_default_of_same_name_and_keeps_others(tmp_path: Path) -> None:
    path = write(tmp_path, TEAM_OVERRIDE)
    plans = resolve_plans(Settings(plans_file=path))
    assert plans["team"] == Plan(
        name="team",
        lane="workflow_team",
        priority=60,
        daily_quota=800,
        rate_limit="15/second",
        tenant_concurrency=5,
        lane_slots=6,
    )
    assert plans["professional"] == DEFAULT_PLANS["professional"]


def test_file_can_add_a_plan(tmp_path: Path) -> None:
    path = write(tmp_path, TEAM_OVERRIDE.replace("  team:", "  enterprise:"))
    plans = resolve_plans(Settings(plans_file=path))
    assert set(plans) == {"professional", "team", "sandbox", "enterprise"}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (TEAM_OVERRIDE.replace("lane_slots: 6", "lane_slots: 6\n    slots: 3"), "plans.team.slots"),
        (TEAM_OVERRIDE + "extra: 1\n", "extra"),
        (TEAM_OVERRIDE.replace("    lane_slots: 6\n", ""), "lane_slots"),
        (TEAM_OVERRIDE.replace('"15/second"', '"fast"'), "rate_limit"),
        (
            TEAM_OVERRIDE.replace("tenant_concurrency: 5", "tenant_concurrency: 0"),
            "tenant_concurrency",
        ),
        (TEAM_OVERRIDE.replace("priority: 60", "priority: high"), "priority"),
        ("plans: [1, 2]\n", "plans"),
    ],
)
def test_bad_file_is_a_config_error_naming_the_key(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_plans_file(path)
    assert named in caught.value.message
    assert str(path) in caught.value.message
    assert "\n" not in caught.value.message


def test_unknown_key_message_says_unknown(tmp_path: Path) -> None:
    path = write(tmp_path, TEAM_OVERRIDE.replace("lane_slots: 6", "lane_slots: 6\n    burst: 3"))
    with pytest.raises(ConfigError, match=r"unknown key 'plans\.team\.burst'"):
        load_plans_file(path)


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MOORLINE_PLANS_FILE"):
        load_plans_file(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_plans_file(write(tmp_path, "plans: {team: [\n"))


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_plans_file(write(tmp_path, "")) == {}


async def test_provider_rereads_after_ttl_only(tmp_path: Path) -> None:
    path = write(tmp_path, TEAM_OVERRIDE)
    clock = FakeClock()
    provider = PlansProvider(Settings(plans_file=path), ttl_s=5.0, clock=clock)
    assert (await provider.get("team")).priority == 60
    path.write_text(TEAM_OVERRIDE.replace("priority: 60", "priority: 70"), encoding="utf-8")
    clock.now += 4.9
    assert (await provider.get("team")).priority == 60  # still cached
    clock.now += 0.2
    assert (await provider.get("team")).priority == 70
    assert (await provider.tenant_caps())["team"] == 5
    assert (await provider.lane_slots())["workflow_team"] == 6


async def test_provider_keeps_last_good_plans_when_file_breaks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, TEAM_OVERRIDE)
    clock = FakeClock()
    provider = PlansProvider(Settings(plans_file=path), ttl_s=1.0, clock=clock)
    path.write_text("plans: {team: {bogus: 1}}\n", encoding="utf-8")
    clock.now += 2
    assert (await provider.get("team")).priority == 60
    assert "plans: reloading 'plans' failed" in caplog.text and "plans.team" in caplog.text


def test_provider_fails_at_start_on_a_bad_file(tmp_path: Path) -> None:
    path = write(tmp_path, "plans: {team: {bogus: 1}}\n")
    with pytest.raises(ConfigError):
        PlansProvider(Settings(plans_file=path))


async def test_provider_unknown_plan() -> None:
    with pytest.raises(ConfigError, match="unknown plan 'gold'"):
        await PlansProvider(Settings()).get("gold")


async def test_community_provider_applies_edition(tmp_path: Path) -> None:
    path = write(tmp_path, TEAM_OVERRIDE)
    provider = PlansProvider(Settings(plans_file=path, edition=Edition.COMMUNITY))
    assert (await provider.get("team")).lane == COMMUNITY_LANE
    assert await provider.lane_slots() == {COMMUNITY_LANE: 8 + 6 + 2}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20/second", (20, 1.0)),
        (" 5 / minute ", (5, 60.0)),
        ("1/hour", (1, 3600.0)),
        ("3/day", (3, 86400.0)),
    ],
)
def test_parse_rate_limit(text: str, expected: tuple[int, float]) -> None:
    assert parse_rate_limit(text) == expected


@pytest.mark.parametrize("text", ["", "0/second", "10", "10/fortnight", "-1/second", "ten/second"])
def test_parse_rate_limit_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate_limit(text)


async def test_a_plan_may_keep_runs_longer_or_for_ever(tmp_path: Path) -> None:
    path = tmp_path / "plans.yaml"
    path.write_text(
        TEAM_OVERRIDE
        + "    retention_days: 90\n"
        + TEAM_OVERRIDE.replace("plans:\n", "").replace("team:", "vault:")
        + "    retention_days: 0\n"
    )
    provider = PlansProvider(Settings(plans_file=path, retention_days=7))
    days = await provider.retention_days()
    assert (days["team"], days["vault"], days["sandbox"]) == (90, 0, 7)
    path.write_text(TEAM_OVERRIDE + "    retention_days: -1\n")
    with pytest.raises(ConfigError, match="retention_days"):
        load_plans_file(path)


def test_the_retention_settings_are_known_and_checked() -> None:
    assert unknown_variables({"MOORLINE_RETENTION_DAYS": "7"}) == []
    [warning] = unknown_variables({"MOORLINE_RETENTION_DAY": "7"})
    assert "did you mean MOORLINE_RETENTION_DAYS?" in warning
    with pytest.raises(ConfigError, match="MOORLINE_RETENTION_DAYS"):
        load_settings(retention_days=-1)
