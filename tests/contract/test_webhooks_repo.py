"""Webhooks on every backend: a tenant lists and deletes its own, never another's; and a key
issued for rotation is listed with the id and prefix it was issued with."""

import uuid

from moorline.db.manager import DatabaseManager
from moorline.db.repos.tenants import TenantsRepo, hash_api_key
from moorline.db.repos.webhooks import WebhooksRepo
from tests.contract.queue_helpers import unique


async def test_webhooks_are_listed_and_deleted_per_tenant(db: DatabaseManager) -> None:
    tenants, hooks = TenantsRepo(db), WebhooksRepo(db)
    a, _ = await tenants.create(unique("hooks-a"), "team")
    b, _ = await tenants.create(unique("hooks-b"), "team")
    first = await hooks.create(a.tenant_id, "review", "s" * 32)
    second = await hooks.create(a.tenant_id, "review", "t" * 32)
    theirs = await hooks.create(b.tenant_id, "review", "u" * 32)
    listed = await hooks.list_for(a.tenant_id)
    assert {hook.webhook_id for hook in listed} == {first.webhook_id, second.webhook_id}
    assert not await hooks.delete(theirs.webhook_id, tenant_id=a.tenant_id)
    assert not await hooks.delete(str(uuid.uuid4()), tenant_id=a.tenant_id)
    assert await hooks.delete(first.webhook_id, tenant_id=a.tenant_id)
    assert not await hooks.delete(first.webhook_id, tenant_id=a.tenant_id)  # already gone
    assert [hook.webhook_id for hook in await hooks.list_for(a.tenant_id)] == [second.webhook_id]
    assert await hooks.get(first.webhook_id) is None
    assert await hooks.get(theirs.webhook_id) is not None


async def test_an_issued_key_is_listed_and_authenticates(db: DatabaseManager) -> None:
    tenants = TenantsRepo(db)
    tenant, first = await tenants.create(unique("rotate"), "team")
    issued, second = await tenants.issue_key(tenant.tenant_id)
    assert second.startswith(issued.prefix) and issued.revoked_at is None
    keys = await tenants.list_keys(tenant.tenant_id)
    assert [key.key_id for key in keys][-1] == issued.key_id
    assert keys[-1] == issued
    assert hash_api_key(second) != hash_api_key(first)
    assert (await tenants.authenticate(second)) is not None
    assert await tenants.revoke_key(keys[0].key_id, tenant_id=tenant.tenant_id)
    assert (await tenants.authenticate(first)) is None
    assert (await tenants.authenticate(second)) is not None
