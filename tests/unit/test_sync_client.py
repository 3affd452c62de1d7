"""``SyncClient`` is ``Client`` without ``await``: the same methods with the same parameters."""

import inspect

import pytest

from moorline import Client, SyncClient

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
