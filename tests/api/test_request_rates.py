"""Rate limits beside the triggers': every tenant request, stream opens, webhook creations.

Each has its own moving window per API key (``MOORLINE_REQUEST_RATE_LIMIT``,
``MOORLINE_STREAM_RATE_LIMIT``, ``MOORLINE_WEBHOOK_RATE_LIMIT``); over it is 429
``rate_limited`` with ``Retry-After`` and ``RateLimit-*``, as for triggers. Triggers count
against their plan's rate only.
"""

import httpx

from moorline.settings import Settings
from tests.api.conftest import MakeApi


def assert_rate_limited(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "rate_limited"
    assert int(response.headers["Retry-After"]) >= 1
    assert response.headers["RateLimit-Remaining"] == "0"


async def test_reads_over_the_request_rate_are_429_per_key(make_api: MakeApi) -> None:
    async with make_api(request_rate_limit="3/minute") as api:
        caller, other = await api.tenant(), await api.tenant()
        for path in ["/v1/usage", "/v1/runs", "/v1/usage"]:
            response = await api.client.get(path, headers=caller.headers)
            assert response.status_code == 200, response.text
        assert_rate_limited(await api.client.get("/v1/runs", headers=caller.headers))
        assert_rate_limited(await api.client.post("/v1/runs/x/cancel", headers=caller.headers))
        # Another key has its own window; triggers count against the plan's rate only.
        assert (await api.client.get("/v1/usage", headers=other.headers)).status_code == 200
        assert (await api.trigger(caller)).status_code == 202


async def test_stream_opens_over_their_rate_are_429(make_api: MakeApi) -> None:
    async with make_api(stream_rate_limit="2/minute") as api:
        caller = await api.tenant()
        run_id = (await api.trigger(caller)).json()["run_id"]
        # A run not found still counts: the window is the key's, whatever it asks for.
        for _ in range(2):
            missing = await api.client.get("/v1/runs/nothing/events", headers=caller.headers)
            assert missing.status_code == 404, missing.text
        assert_rate_limited(
            await api.client.get(f"/v1/runs/{run_id}/events", headers=caller.headers)
        )
        assert (await api.client.get(f"/v1/runs/{run_id}", headers=caller.headers)).is_success


async def test_webhook_creations_over_their_rate_are_429(make_api: MakeApi) -> None:
    async with make_api(webhook_rate_limit="2/hour") as limited:
        caller = await limited.tenant()
        for _ in range(2):
            created = await limited.client.post(
                "/v1/webhooks", json={"workflow": "review"}, headers=caller.headers
            )
            assert created.status_code == 201, created.text
        assert_rate_limited(
            await limited.client.post(
                "/v1/webhooks", json={"workflow": "review"}, headers=caller.headers
            )
        )


def test_the_default_limits_are_generous_enough_for_the_dashboard() -> None:
    # The dashboard polls a few routes every couple of seconds per open tab and reopens a
    # stream at most once a second; the defaults leave a wide margin (docs/api.md).
    settings = Settings()
    assert settings.request_rate_limit == "100/second"
    assert settings.stream_rate_limit == "10/second"
    assert settings.webhook_rate_limit == "10/minute"
