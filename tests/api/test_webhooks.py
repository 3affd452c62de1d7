"""Webhooks: GitHub's signature over the raw body, checked before parsing; delivery id dedup."""

import json
import uuid

import pytest

from moorline.api.routes.webhooks import sign, verify_signature
from moorline.errors import InvalidSignature
from moorline.types import RunStatus
from tests.api.conftest import Api, Caller, MakeApi

# GitHub's published test vector ("Validating webhook deliveries").
GITHUB_SECRET = "It's a Secret to Everybody"
GITHUB_PAYLOAD = b"Hello, World!"
GITHUB_SIGNATURE = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"


def test_githubs_test_vector_verifies() -> None:
    assert sign(GITHUB_SECRET, GITHUB_PAYLOAD) == GITHUB_SIGNATURE
    verify_signature(GITHUB_SECRET, GITHUB_PAYLOAD, [GITHUB_SIGNATURE])
    verify_signature(
        GITHUB_SECRET, GITHUB_PAYLOAD, [GITHUB_SIGNATURE.upper().replace("SHA", "sha")]
    )


@pytest.mark.parametrize(
    ("secret", "payload", "headers"),
    [
        (GITHUB_SECRET, b"Hello, World?", [GITHUB_SIGNATURE]),  # tampered body
        ("It's a Secret to Everyone", GITHUB_PAYLOAD, [GITHUB_SIGNATURE]),  # wrong secret
        (GITHUB_SECRET, GITHUB_PAYLOAD, []),  # missing
        (GITHUB_SECRET, GITHUB_PAYLOAD, [GITHUB_SIGNATURE, GITHUB_SIGNATURE]),  # duplicated
        (GITHUB_SECRET, GITHUB_PAYLOAD, [GITHUB_SIGNATURE.removeprefix("sha256=")]),
        (GITHUB_SECRET, GITHUB_PAYLOAD, ["sha1=" + "0" * 40]),
    ],
    ids=["tampered", "wrong-secret", "missing", "duplicated", "no-prefix", "sha1"],
)
def test_anything_else_does_not_verify(secret: str, payload: bytes, headers: list[str]) -> None:
    with pytest.raises(InvalidSignature):
        verify_signature(secret, payload, headers)


async def new_hook(api: Api, caller: Caller, secret: str | None = None) -> dict[str, str]:
    body = {"workflow": "review"} if secret is None else {"workflow": "review", "secret": secret}
    created = await api.client.post("/v1/webhooks", json=body, headers=caller.headers)
    assert created.status_code == 201, created.text
    hook: dict[str, str] = created.json()
    # No MOORLINE_PUBLIC_URL in these apps: the path alone, never the request's Host.
    assert hook["url"] == f"/v1/hooks/{hook['webhook_id']}"
    assert hook["secret"] == secret if secret is not None else len(hook["secret"]) == 64
    return hook


async def deliver(
    api: Api,
    hook: dict[str, str],
    body: bytes,
    *,
    signature: str | None,
    delivery: str | None = "a-delivery-id",
) -> tuple[int, dict[str, object]]:
    headers = {"X-GitHub-Event": "pull_request", "Content-Type": "application/json"}
    if signature is not None:
        headers["X-Hub-Signature-256"] = signature
    if delivery is not None:
        headers["X-GitHub-Delivery"] = delivery
    response = await api.client.post(
        f"/v1/hooks/{hook['webhook_id']}", content=body, headers=headers
    )
    return response.status_code, response.json()


async def test_the_test_vector_passes_the_signature_check_of_a_real_hook(api: Api) -> None:
    caller = await api.tenant()
    hook = await new_hook(api, caller, secret=GITHUB_SECRET)
    status, body = await deliver(api, hook, GITHUB_PAYLOAD, signature=GITHUB_SIGNATURE)
    # Verified, then parsed: "Hello, World!" is not JSON.
    assert (status, body["error"]["code"]) == (400, "invalid_json")  # type: ignore[index]
    assert await api.count_runs(caller) == 0


async def test_a_signed_delivery_starts_the_workflow_with_its_payload(api: Api) -> None:
    caller = await api.tenant()
    hook = await new_hook(api, caller)
    payload = json.dumps({"action": "opened", "number": 7}).encode()
    status, body = await deliver(
        api, hook, payload, signature=sign(hook["secret"], payload), delivery=str(uuid.uuid4())
    )
    assert status == 202, body
    run = await api.client.get(f"/v1/runs/{body['run_id']}", headers=caller.headers)
    assert run.json()["input"] == {
        "payload": {"action": "opened", "number": 7},
        "event": "pull_request",
    }
    assert run.json()["workflow"] == "review"
    assert run.json()["status"] == RunStatus.QUEUED


async def test_bad_signatures_are_401_and_store_nothing(api: Api) -> None:
    caller = await api.tenant()
    hook = await new_hook(api, caller)
    payload = json.dumps({"action": "opened"}).encode()
    good = sign(hook["secret"], payload)
    attempts = {
        "tampered body": (payload.replace(b"opened", b"closed"), good),
        "wrong secret": (payload, sign("not-the-secret-at-all", payload)),
        "missing header": (payload, None),
        "re-serialised body": (json.dumps(json.loads(payload), indent=2).encode(), good),
    }
    for what, (body, signature) in attempts.items():
        status, error = await deliver(api, hook, body, signature=signature, delivery=what)
        assert (status, error["error"]["code"]) == (401, "invalid_signature"), what  # type: ignore[index]
    assert await api.count_runs(caller) == 0


async def test_a_repeated_delivery_is_one_run(api: Api) -> None:
    caller = await api.tenant()
    hook = await new_hook(api, caller)
    payload = json.dumps({"action": "synchronize"}).encode()
    signature = sign(hook["secret"], payload)
    delivery = str(uuid.uuid4())
    first = await deliver(api, hook, payload, signature=signature, delivery=delivery)
    again = await deliver(api, hook, payload, signature=signature, delivery=delivery)
    assert (first[0], again[0]) == (202, 200)
    assert first[1]["run_id"] == again[1]["run_id"]
    other = await deliver(api, hook, payload, signature=signature, delivery=str(uuid.uuid4()))
    assert other[0] == 202
    assert await api.count_runs(caller) == 2


async def test_unknown_hooks_and_workflows_are_404(api: Api) -> None:
    caller = await api.tenant()
    missing = await api.client.post(
        f"/v1/hooks/{uuid.uuid4()}", content=b"{}", headers={"X-Hub-Signature-256": "sha256=0"}
    )
    assert missing.json()["error"]["code"] == "webhook_not_found"
    unknown = await api.client.post(
        "/v1/webhooks", json={"workflow": "no_such_workflow"}, headers=caller.headers
    )
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "workflow_not_found")
    short = await api.client.post(
        "/v1/webhooks", json={"workflow": "review", "secret": "short"}, headers=caller.headers
    )
    assert short.status_code == 422


async def test_a_delivery_without_its_id_is_refused_and_stores_nothing(api: Api) -> None:
    caller = await api.tenant()
    hook = await new_hook(api, caller)
    payload = json.dumps({"action": "opened"}).encode()
    signature = sign(hook["secret"], payload)
    # A captured signed body sent again without an id would otherwise start a run each time.
    for delivery in (None, "", "has space"):
        status, error = await deliver(api, hook, payload, signature=signature, delivery=delivery)
        assert (status, error["error"]["code"]) == (422, "invalid_request"), delivery  # type: ignore[index]
    assert await api.count_runs(caller) == 0


async def test_the_webhook_url_comes_from_the_public_url_not_the_host_header(
    make_api: MakeApi,
) -> None:
    async with make_api(public_url="https://hooks.example.com/") as api:
        caller = await api.tenant()
        created = await api.client.post(
            "/v1/webhooks",
            json={"workflow": "review"},
            headers={**caller.headers, "Host": "attacker.example"},
        )
    assert created.status_code == 201, created.text
    hook = created.json()
    assert hook["url"] == f"https://hooks.example.com/v1/hooks/{hook['webhook_id']}"
