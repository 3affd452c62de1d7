"""``SyncClient`` is ``Client`` without ``await``: the same methods with the same parameters."""

import inspect
import json

import httpx
import pytest

from moorline import Client, SyncClient
from moorline.errors import InvalidInput

ASYNC_ONLY = {"aclose"}
SYNC_ONLY = {"close"}


def public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_both_clients_have_the_same_methods() -> None:
    assert public(Client) - ASYNC_ONLY == public(SyncClient) - SYNC_ONLY


@pytest.mark.parametrize("name", sorted(public(Client) - ASYNC_ONLY))
def test_each_method_takes_the_same_parameters(name: str) -> None:
    theirs = inspect.signature(getattr(Client, name)).parameters
    ours = inspect.signature(getattr(SyncClient, name)).parameters
    assert [(p.name, p.kind, p.default) for p in theirs.values()] == [
        (p.name, p.kind, p.default) for p in ours.values()
    ]


def test_url_and_key_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOORLINE_URL", raising=False)
    monkeypatch.delenv("MOORLINE_API_KEY", raising=False)
    with SyncClient() as plain:
        assert plain.url == "http://127.0.0.1:8000"
    monkeypatch.setenv("MOORLINE_URL", "http://moorline.example:9000/")
    with SyncClient() as configured:
        assert configured.url == "http://moorline.example:9000"
    with SyncClient("http://given:1") as given:
        assert given.url == "http://given:1"


def test_trigger_many_sends_1000_items_a_request_in_order() -> None:
    sent: list[list[dict[str, object]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/workflows/add/runs/batch"
        items = json.loads(request.content)["runs"]
        sent.append(items)
        results = [
            {"status_code": 202, "run_id": f"r-{item['input']['n']}", "status": "queued"}
            for item in items
        ]
        return httpx.Response(
            200,
            json={
                "workflow": "add",
                "created": len(items),
                "existing": 0,
                "refused": 0,
                "results": results,
            },
        )

    items = [{"input": {"n": n}, "idempotency_key": None} for n in range(1_500)]
    with SyncClient("http://x", "ml_key", transport=httpx.MockTransport(answer)) as client:
        answers = client.trigger_many("add", items)
        with pytest.raises(InvalidInput, match="inptu"):
            client.trigger_many("add", [{"inptu": {}}])
    assert [len(batch) for batch in sent] == [1_000, 500]
    assert sent[0][0] == {"input": {"n": 0}}  # unset options are left out
    assert [a.run_id for a in answers] == [f"r-{n}" for n in range(1_500)]
