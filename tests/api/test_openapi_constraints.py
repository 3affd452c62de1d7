"""The OpenAPI document constrains parameters exactly as the server refuses them.

A client generated from ``/openapi.json`` (or Schemathesis) must not be able to send, as
valid, what the server answers 422: cursors, event ids and plan names are constrained in the
document, and the values at each bound are served or refused as the document says.
"""

from typing import Any

from tests.api.conftest import ADMIN, Api


def parameter(document: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    [found] = [p for p in document["paths"][path]["get"]["parameters"] if p["name"] == name]
    schema: dict[str, Any] = found["schema"]["anyOf"][0]
    return schema


async def test_event_ids_are_documented_and_refused_at_the_same_bounds(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    for path in ("/v1/runs/{run_id}/events", "/v1/admin/runs/{run_id}/events"):
        for name in ("after", "last-event-id"):
            assert parameter(document, path, name) == {
                "type": "integer",
                "minimum": 0,
                "maximum": 2**31 - 1,
            }
    caller = await api.tenant()
    run_id = (await api.trigger(caller)).json()["run_id"]
    url = f"/v1/runs/{run_id}/events"
    for bad in ("-1", "2147483648", "x"):
        refused = await api.client.get(url, params={"after": bad}, headers=caller.headers)
        assert refused.status_code == 422, refused.text
        refused = await api.client.get(url, headers={**caller.headers, "Last-Event-ID": bad})
        assert refused.status_code == 422, refused.text
    # The largest documented id streams (nothing after it); the stream ends once cancelled.
    assert (await api.client.post(f"/v1/runs/{run_id}/cancel", headers=caller.headers)).is_success
    served = await api.client.get(url, params={"after": "2147483647"}, headers=caller.headers)
    assert served.status_code == 200, served.text


async def test_cursors_are_documented_as_url_safe_base64(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    for path in ("/v1/runs", "/v1/admin/runs"):
        schema = parameter(document, path, "cursor")
        assert schema["pattern"] == "^[A-Za-z0-9_-]+$"
        assert (schema["minLength"], schema["maxLength"]) == (1, 500)
    assert parameter(document, "/v1/admin/tenants", "cursor")["pattern"] == "^[0-9]{1,9}$"
    caller = await api.tenant()
    # Outside the alphabet: base64 decoding would have skipped the characters; now 422.
    for cursor in ("!!!!", "a b", ""):
        refused = await api.client.get(
            "/v1/runs", params={"cursor": cursor}, headers=caller.headers
        )
        assert refused.status_code == 422, (cursor, refused.text)
    refused = await api.client.get("/v1/admin/tenants", params={"cursor": "1" * 10}, headers=ADMIN)
    assert refused.status_code == 422, refused.text


async def test_plan_names_are_the_configured_plans(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    configured = sorted((await api.app.state.services.plans.plans()).keys())
    for schema_name in ("TenantCreate", "TenantPlanChange"):
        plan = document["components"]["schemas"][schema_name]["properties"]["plan"]
        assert plan["enum"] == configured
        assert "x-moorline-plan-name" not in plan
    refused = await api.client.post(
        "/v1/admin/tenants", json={"name": "n", "plan": "no_such_plan"}, headers=ADMIN
    )
    assert refused.status_code == 422, refused.text


async def test_a_deliverys_required_headers_are_documented_as_required(api: Api) -> None:
    document = (await api.client.get("/openapi.json")).json()
    parameters = {
        p["name"]: p for p in document["paths"]["/v1/hooks/{webhook_id}"]["post"]["parameters"]
    }
    signature, delivery = parameters["x-hub-signature-256"], parameters["x-github-delivery"]
    assert signature["required"] and delivery["required"]
    assert signature["schema"]["pattern"] == "^sha256=[0-9a-fA-F]{64}$"
    assert delivery["schema"]["pattern"] == "^[!-~]{1,100}$"
    # Still checked by the route, signature first: a forgery lacking both is 401, not 422.
    caller = await api.tenant()
    hook = await api.client.post(
        "/v1/webhooks", json={"workflow": "review"}, headers=caller.headers
    )
    refused = await api.client.post(f"/v1/hooks/{hook.json()['webhook_id']}", json={})
    assert refused.status_code == 401, refused.text
