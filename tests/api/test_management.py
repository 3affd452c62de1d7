"""Tenant and key management: API keys issued and revoked, webhooks listed and deleted, and the
``Location`` of a 202."""

import json
import uuid

import pytest

from moorline.api.routes.webhooks import sign
from tests.api.conftest import ADMIN, Api, MakeApi
from tests.api.test_webhooks import deliver, new_hook
from tests.helpers import wait_for


async def test_a_second_key_works_and_a_revoked_one_stops_at_once(api: Api) -> None:
    caller = await api.tenant()
    keys_url = f"/v1/admin/tenants/{caller.tenant_id}/keys"
    issued = await api.client.post(keys_url, headers=ADMIN)
    assert issued.status_code == 201, issued.text
    second = issued.json()
    assert second["api_key"].startswith(second["prefix"]) and second["revoked_at"] is None
    headers = {"Authorization": f"Bearer {second['api_key']}"}
    assert (await api.client.get("/v1/usage", headers=headers)).status_code == 200

    listed = (await api.client.get(keys_url, headers=ADMIN)).json()["keys"]
    assert [key["key_id"] for key in listed][1] == second["key_id"]
    assert all("api_key" not in key for key in listed)
    first = listed[0]
    assert caller.api_key.startswith(first["prefix"])

    revoked = await api.client.delete(f"{keys_url}/{first['key_id']}", headers=ADMIN)
    assert revoked.status_code == 204
    assert (await api.client.get("/v1/usage", headers=caller.headers)).status_code == 401
    assert (await api.client.get("/v1/usage", headers=headers)).status_code == 200
    again = await api.client.delete(f"{keys_url}/{first['key_id']}", headers=ADMIN)
    assert (again.status_code, again.json()["error"]["code"]) == (404, "api_key_not_found")
    after = (await api.client.get(keys_url, headers=ADMIN)).json()["keys"]
    assert after[0]["revoked_at"] is not None


async def test_key_routes_refuse_unknown_tenants_and_tenant_keys(api: Api) -> None:
    caller = await api.tenant()
    other = await api.tenant()
    unknown = await api.client.post(f"/v1/admin/tenants/{uuid.uuid4()}/keys", headers=ADMIN)
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "tenant_not_found")
    as_tenant = await api.client.get(
        f"/v1/admin/tenants/{caller.tenant_id}/keys", headers=caller.headers
    )
    assert as_tenant.status_code == 403
    # Another tenant's key id under this tenant revokes nothing.
    others = await api.client.get(f"/v1/admin/tenants/{other.tenant_id}/keys", headers=ADMIN)
    key_id = others.json()["keys"][0]["key_id"]
    wrong = await api.client.delete(
        f"/v1/admin/tenants/{caller.tenant_id}/keys/{key_id}", headers=ADMIN
    )
    assert wrong.status_code == 404
    assert (await api.client.get("/v1/usage", headers=other.headers)).status_code == 200


async def test_a_key_revoked_through_another_api_process_stops_within_5_s(
    make_api: MakeApi,
) -> None:
    async with make_api() as one, make_api() as two:
        caller = await one.tenant()
        # The second process authenticates the key, and keeps it for its cache's TTL.
        assert (await two.client.get("/v1/usage", headers=caller.headers)).status_code == 200
        listed = await one.client.get(f"/v1/admin/tenants/{caller.tenant_id}/keys", headers=ADMIN)
        key_id = listed.json()["keys"][0]["key_id"]
        url = f"/v1/admin/tenants/{caller.tenant_id}/keys/{key_id}"
        assert (await one.client.delete(url, headers=ADMIN)).status_code == 204

        async def refused() -> bool:
            response = await two.client.get("/v1/usage", headers=caller.headers)
            return response.status_code == 401

        # The documented bound is 5 s (AUTH_CACHE_TTL_S); a little slack for a loaded machine.
        assert await wait_for(refused, timeout_s=6.0, interval_s=0.1, message="revocation")


async def test_webhooks_are_listed_and_deleted_by_their_tenant_only(api: Api) -> None:
    caller = await api.tenant()
    other = await api.tenant()
    first, second = await new_hook(api, caller), await new_hook(api, caller)
    listed = await api.client.get("/v1/webhooks", headers=caller.headers)
    assert listed.status_code == 200
    hooks = listed.json()["webhooks"]
    assert [hook["webhook_id"] for hook in hooks] == [first["webhook_id"], second["webhook_id"]]
    assert hooks[0] == {
        "webhook_id": first["webhook_id"],
        "workflow": "review",
        "url": f"/v1/hooks/{first['webhook_id']}",
    }
    assert (await api.client.get("/v1/webhooks", headers=other.headers)).json()["webhooks"] == []

    stranger = await api.client.delete(f"/v1/webhooks/{first['webhook_id']}", headers=other.headers)
    assert (stranger.status_code, stranger.json()["error"]["code"]) == (404, "webhook_not_found")
    gone = await api.client.delete(f"/v1/webhooks/{first['webhook_id']}", headers=caller.headers)
    assert gone.status_code == 204
    remaining = (await api.client.get("/v1/webhooks", headers=caller.headers)).json()["webhooks"]
    assert [hook["webhook_id"] for hook in remaining] == [second["webhook_id"]]
    payload = json.dumps({"action": "opened"}).encode()
    status, body = await deliver(api, first, payload, signature=sign(first["secret"], payload))
    assert (status, body["error"]["code"]) == (404, "webhook_not_found")  # type: ignore[index]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "starlette"])
async def test_a_202_carries_the_location_of_the_new_run(make_api: MakeApi, fast: bool) -> None:
    async with make_api(fast_paths=fast) as api:
        caller = await api.tenant()
        created = await api.trigger(caller, "echo", input={}, idempotency_key="loc-1")
        assert created.status_code == 202
        location = created.headers["location"]
        assert location == f"/v1/runs/{created.json()['run_id']}"
        assert (await api.client.get(location, headers=caller.headers)).status_code == 200
        repeated = await api.trigger(caller, "echo", input={}, idempotency_key="loc-1")
        assert repeated.status_code == 200 and "location" not in repeated.headers
