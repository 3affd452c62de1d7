"""``GET /v1/workflows``: each workflow's input schema (from its signature), limits, lanes."""

from tests.api.conftest import Api


async def test_the_catalogue_lists_every_workflow_with_its_schema_and_limits(api: Api) -> None:
    caller = await api.tenant("team")
    response = await api.client.get("/v1/workflows", headers=caller.headers)
    assert response.status_code == 200, response.text
    entries = {entry["name"]: entry for entry in response.json()["workflows"]}
    assert list(entries) == sorted(entries)
    assert {"echo", "add", "review"} <= set(entries)

    add = entries["add"]
    assert add["limits"] == {"max_attempts": 5, "timeout_s": 60.0, "soft_timeout_s": None}
    assert add["lane"] == "workflow_team"
    assert {"workflow_team", "workflow_sandbox"} <= set(add["lanes"])
    schema = add["parameters"]
    assert schema["title"] == "add"
    assert schema["required"] == ["a", "b"]
    assert schema["properties"]["a"]["type"] == "integer"
    assert entries["echo"]["parameters"]["properties"]["message"]["default"] == ""


async def test_the_catalogue_needs_a_key(api: Api) -> None:
    response = await api.client.get("/v1/workflows")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"
