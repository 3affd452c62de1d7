"""Settings: every MOORLINE_* name of docs/design.md, validated at start with one-line errors."""

import pytest

from moorline.errors import ConfigError
from moorline.settings import DEFAULT_DATABASE_URL, Edition, Settings, load_settings

DESIGN_NAMES = [
    "DATABASE_URL",
    "DATABASE_URLS",
    "REDIS_URL",
    "REDIS_PREFIX",
    "ADMIN_TOKEN",
    "EDITION",
    "PLANS_FILE",
    "LEASE_TTL",
    "REAPER_INTERVAL",
    "EXECUTION_TIMEOUT",
    "PERMISSION_TIMEOUT",
    "SSE_PING_INTERVAL",
    "MAX_BODY_BYTES",
    "LLM_BASE_URL",
    "LLM_API_KEY",
    "LLM_MODEL",
]


def test_every_design_name_is_a_setting() -> None:
    fields = {name.upper() for name in Settings.model_fields}
    assert set(DESIGN_NAMES) <= fields


def test_defaults_follow_design() -> None:
    s = Settings()
    assert s.database_url == DEFAULT_DATABASE_URL
    assert s.redis_url is None
    assert s.redis_prefix == "mo"
    assert s.edition is Edition.CLOUD
    assert (s.lease_ttl, s.execution_timeout, s.permission_timeout) == (90.0, 1800.0, 300.0)
    assert s.sse_ping_interval == 15.0
    assert s.max_body_bytes == 1024 * 1024
    assert (s.db_pool_size, s.db_max_overflow, s.db_pool_timeout, s.db_pool_recycle) == (
        5,
        10,
        30.0,
        300.0,
    )
    assert s.db_pool_pre_ping is True
    assert s.cancel_grace == 10.0


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOORLINE_LEASE_TTL", "1.5")
    monkeypatch.setenv("MOORLINE_EDITION", "community")
    monkeypatch.setenv("MOORLINE_CANCEL_GRACE", "0.25")
    monkeypatch.setenv(
        "MOORLINE_DATABASE_URLS", "postgresql+asyncpg://a/x, postgresql+asyncpg://b/x"
    )
    s = load_settings()
    assert s.lease_ttl == 1.5
    assert s.edition is Edition.COMMUNITY
    assert s.cancel_grace == 0.25
    assert s.effective_database_urls == ["postgresql+asyncpg://a/x", "postgresql+asyncpg://b/x"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MOORLINE_LEASE_TTL", "abc"),
        ("MOORLINE_LEASE_TTL", "-1"),
        ("MOORLINE_EDITION", "enterprise"),
        ("MOORLINE_MAX_BODY_BYTES", "0"),
        ("MOORLINE_CANCEL_GRACE", "-1"),
        ("MOORLINE_REDIS_PREFIX", "has space"),
        ("MOORLINE_PUBLIC_URL", "moorline.example.com"),
        ("MOORLINE_PUBLIC_URL", "https://moorline.example.com/?x=1"),
    ],
)
def test_bad_value_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"{name}: ")
    assert "\n" not in message


def test_permission_timeout_cannot_exceed_execution_timeout() -> None:
    with pytest.raises(ConfigError, match="permission_timeout"):
        load_settings(permission_timeout=10, execution_timeout=5)


def test_secrets_are_hidden_in_repr() -> None:
    s = Settings(admin_token="very-secret", llm_api_key="sk-secret")
    assert "very-secret" not in repr(s)
    assert "sk-secret" not in repr(s)
