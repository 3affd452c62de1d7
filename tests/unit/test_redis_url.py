"""``MOORLINE_REDIS_URL``: the three forms it accepts, and one clear line for anything else."""

import pytest

from moorline.errors import ConfigError
from moorline.runtime.redis_client import RedisConnector, RedisTopology, parse_redis_url


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://u:p@cache:6380/2", "unix:///run/redis.sock"]
)
def test_one_server_urls_are_kept_as_they_are(url: str) -> None:
    target = parse_redis_url(url)
    assert (target.topology, target.url) == (RedisTopology.SERVER, url)


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    target = parse_redis_url(
        "redis+sentinel://:secret@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/3"
        "?sentinel_password=s%20p"
    )
    assert target.topology is RedisTopology.SENTINEL
    assert target.nodes == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (target.service_name, target.db) == ("mymaster", 3)
    assert (target.username, target.password) == (None, "secret")
    assert target.sentinel_password == "s p"
    assert parse_redis_url("rediss+sentinel://h:1/m").ssl


def test_a_cluster_url_names_its_first_nodes() -> None:
    target = parse_redis_url("redis+cluster://user:pw@n1:7000,n2:7001")
    assert target.topology is RedisTopology.CLUSTER
    assert target.nodes == (("n1", 7000), ("n2", 7001))
    assert (target.username, target.password, target.db) == ("user", "pw", 0)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("127.0.0.1:6379", "not a URL"),
        ("http://127.0.0.1:6379", "unknown scheme 'http'"),
        ("redis://127.0.0.1:port/0", "MOORLINE_REDIS_URL"),
        ("redis+sentinel://h:26379", "names the master's service"),
        ("redis+sentinel://h:26379/m/x", "'x' is not a number"),
        ("redis+sentinel://h:26379/m?sentinel_pasword=x", "unknown parameter 'sentinel_pasword'"),
        ("redis+cluster://n1:7000/1", "one database"),
        ("redis+cluster://n1:99999", "'n1:99999' is not host:port"),
        ("redis+cluster://:7000", "':7000' is not host:port"),
        ("redis+cluster://a:b@n1:7000?x=1", "unknown parameter 'x'"),
    ],
)
def test_a_bad_url_is_one_config_error_naming_the_setting(url: str, said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        RedisConnector(url)
    message = str(raised.value)
    assert message.startswith("MOORLINE_REDIS_URL: ")
    assert said in message
    assert "\n" not in message


def test_a_password_never_shows_in_the_error() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_redis_url("user:hunter2@cache")
    assert "hunter2" not in str(raised.value)


async def test_a_one_server_urls_own_options_are_kept() -> None:
    client = RedisConnector("redis://127.0.0.1:1/0?socket_timeout=7&client_name=x").client(
        max_connections=3, decode_responses=True
    )
    try:
        options = client.get_connection_kwargs()
        assert (options["socket_timeout"], options["client_name"]) == (7.0, "x")
        assert options["decode_responses"] is True
    finally:
        await client.aclose()
