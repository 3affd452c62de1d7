"""Tenants and API keys on every backend: keys shown once and stored hashed, auth, revocation."""

import asyncio
import hashlib
from typing import Any

import pytest
from sqlalchemy import func, select

from moorline.db.manager import DatabaseManager
from moorline.db.repos.tenants import TenantExists, TenantsRepo
from moorline.db.schema import api_keys, tenants
from moorline.errors import Conflict, InvalidInput, NotFound
from moorline.types import TenantId
from tests.contract.queue_helpers import unique


async def key_rows(db: DatabaseManager, tenant_id: str) -> list[dict[str, Any]]:
    async with db.connect() as conn:
        rows = await conn.execute(select(api_keys).where(api_keys.c.tenant_id == tenant_id))
        return [dict(row) for row in rows.mappings()]


async def count(db: DatabaseManager, table: Any, *conditions: Any) -> int:
    async with db.connect() as conn:
        total = await conn.scalar(select(func.count()).select_from(table).where(*conditions))
    assert total is not None
    return int(total)


async def test_create_shows_the_key_once_and_stores_only_its_hash(db: DatabaseManager) -> None:
    repo = TenantsRepo(db)
    name = unique("acme")
    tenant, api_key = await repo.create(name, "team")
    assert (tenant.name, tenant.plan) == (name, "team")
    assert api_key.startswith("ml_") and len(api_key) >= 40
    [row] = await key_rows(db, tenant.tenant_id)
    assert row["key_hash"] == hashlib.sha256(api_key.encode()).hexdigest()
    assert row["prefix"] == api_key[:8]
    assert row["revoked_at"] is None
    # The clear key appears nowhere in the stored rows, not even in part beyond the prefix.
    stored = repr(row) + repr(await repo.get(tenant.tenant_id))
    assert api_key not in stored
    assert api_key[8:] not in stored
    [listed] = await repo.list_keys(tenant.tenant_id)
    assert (listed.prefix, listed.revoked_at) == (api_key[:8], None)
    assert api_key not in repr(listed)


async def test_authenticate_by_key_until_it_is_revoked(db: DatabaseManager) -> None:
    repo = TenantsRepo(db)
    tenant, first = await repo.create(unique("acme"), "team")
    other, other_key = await repo.create(unique("other"), "sandbox")
    assert await repo.authenticate(first) == tenant
    assert await repo.authenticate(other_key) == other
    for wrong in ["", "ml_", first[:-1], first + "x", first.upper(), "x" * 10_000]:
        assert await repo.authenticate(wrong) is None
    second = await repo.create_key(tenant.tenant_id)
    assert second != first and await repo.authenticate(second) == tenant
    first_id = next(
        k.key_id for k in await repo.list_keys(tenant.tenant_id) if first[:8] == k.prefix
    )
    # Another tenant cannot revoke it.
    assert not await repo.revoke_key(first_id, tenant_id=other.tenant_id)
    assert await repo.authenticate(first) == tenant
    assert await repo.revoke_key(first_id, tenant_id=tenant.tenant_id)
    assert await repo.authenticate(first) is None
    assert not await repo.revoke_key(first_id)
    # Revoking one key leaves the other working.
    assert await repo.authenticate(second) == tenant
    revoked = {k.key_id: k.revoked_at for k in await repo.list_keys(tenant.tenant_id)}
    assert revoked[first_id] is not None
    assert not await repo.revoke_key("no-such-key")


async def test_create_key_for_an_unknown_tenant_is_not_found(db: DatabaseManager) -> None:
    with pytest.raises(NotFound):
        await TenantsRepo(db).create_key(TenantId("00000000-0000-4000-8000-000000000000"))


async def test_a_duplicate_name_conflicts_and_writes_nothing(db: DatabaseManager) -> None:
    repo = TenantsRepo(db)
    name = unique("dup")
    tenant, _ = await repo.create(name, "team")
    tenants_before = await count(db, tenants)
    keys_before = await count(db, api_keys)
    with pytest.raises(TenantExists, match=name) as caught:
        await repo.create(name, "professional")
    assert isinstance(caught.value, Conflict) and caught.value.status == 409
    assert await count(db, tenants) == tenants_before
    assert await count(db, api_keys) == keys_before
    assert await repo.get_by_name(name) == tenant


async def test_bad_names_and_plans_are_refused(db: DatabaseManager) -> None:
    before = await count(db, tenants)
    bad = [("", "team"), ("   ", "team"), ("x" * 201, "team"), ("ok", ""), ("ok", "p" * 65)]
    for name, plan in bad:
        with pytest.raises(InvalidInput):
            await TenantsRepo(db).create(name, plan)
    assert await count(db, tenants) == before


async def test_get_list_and_set_plan(db: DatabaseManager) -> None:
    repo = TenantsRepo(db)
    made = [(await repo.create(unique(f"list{i}"), "sandbox"))[0] for i in range(3)]
    assert await repo.get(made[1].tenant_id) == made[1]
    assert await repo.get(TenantId("00000000-0000-4000-8000-000000000000")) is None
    assert await repo.get_by_name(made[2].name) == made[2]
    assert await repo.get_by_name(made[2].name.upper()) is None
    assert await repo.get_by_name(unique("nobody")) is None
    everything = await repo.list(limit=1_000)
    ids = [t.tenant_id for t in everything]
    assert all(t.tenant_id in ids for t in made)
    assert everything == sorted(everything, key=lambda t: (t.created_at, t.tenant_id))
    assert await repo.list(limit=2, offset=1) == everything[1:3]
    assert await repo.list(limit=0) == []
    assert await repo.set_plan(made[0].tenant_id, "professional")
    changed = await repo.get(made[0].tenant_id)
    assert changed is not None and changed.plan == "professional"
    assert await repo.authenticate("ml_nothing") is None
    assert not await repo.set_plan(TenantId("00000000-0000-4000-8000-000000000000"), "team")


async def test_concurrent_creates_of_one_name_make_one_tenant(db: DatabaseManager) -> None:
    repo = TenantsRepo(db)
    name = unique("race")
    keys_before = await count(db, api_keys)
    outcomes = await asyncio.gather(
        *(repo.create(name, "team") for _ in range(10)), return_exceptions=True
    )
    made = [o for o in outcomes if isinstance(o, tuple)]
    assert len(made) == 1, outcomes
    assert all(isinstance(o, TenantExists) for o in outcomes if not isinstance(o, tuple))
    assert await count(db, tenants, tenants.c.name == name) == 1
    assert await count(db, api_keys) == keys_before + 1
    tenant, api_key = made[0]
    assert await repo.authenticate(api_key) == tenant


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingManager:
    """Counts the reads a repository opens (``connect``), passing everything else through."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)

    def connect(self) -> Any:
        self.reads += 1
        return self._db.connect()


async def test_the_auth_cache_is_bounded_by_its_ttl_and_dropped_on_changes_made_here(
    db: DatabaseManager,
) -> None:
    clock = Clock()
    counted = CountingManager(db)
    cached = TenantsRepo(counted, auth_ttl_s=5.0, clock=clock)  # type: ignore[arg-type]
    elsewhere = TenantsRepo(db)  # another process, as far as the cache can tell
    tenant, key = await elsewhere.create(unique("cached"), "team")
    # Concurrent lookups of one key share one read; a found key is then trusted.
    assert await asyncio.gather(*(cached.authenticate(key) for _ in range(20))) == [tenant] * 20
    assert await cached.authenticate(key) == tenant
    assert counted.reads == 1
    # A change made elsewhere is seen once the TTL has passed, not before.
    assert await elsewhere.set_plan(tenant.tenant_id, "sandbox")
    clock.now += 4.9
    found = await cached.authenticate(key)
    assert found is not None and found.plan == "team"
    clock.now += 0.2
    found = await cached.authenticate(key)
    assert found is not None and found.plan == "sandbox"
    [listed] = await elsewhere.list_keys(tenant.tenant_id)
    assert await elsewhere.revoke_key(listed.key_id)
    assert await cached.authenticate(key) is not None
    clock.now += 5.1
    assert await cached.authenticate(key) is None
    # Changes made through the caching repository itself take effect at once.
    second = await cached.create_key(tenant.tenant_id)
    assert await cached.authenticate(second) is not None  # unknown keys are never kept
    assert await cached.set_plan(tenant.tenant_id, "professional")
    found = await cached.authenticate(second)
    assert found is not None and found.plan == "professional"
    [_, second_id] = [k.key_id for k in await cached.list_keys(tenant.tenant_id)]
    assert await cached.revoke_key(second_id)
    assert await cached.authenticate(second) is None


async def test_a_key_that_names_nothing_costs_one_read_per_ttl(db: DatabaseManager) -> None:
    clock = Clock()
    counted = CountingManager(db)
    cached = TenantsRepo(counted, auth_ttl_s=5.0, clock=clock, max_entries=3)  # type: ignore[arg-type]
    elsewhere = TenantsRepo(db)
    tenant, key = await elsewhere.create(unique("negative"), "team")
    # Not shaped as a key: refused without a read.
    for malformed in ["", "ml_", key[:-1], key + "x", "x" * 10_000, "ml_" + "*" * 43]:
        assert await cached.authenticate(malformed) is None
    assert counted.reads == 0
    # Well shaped but unknown: one read, then refused from memory until the TTL has passed.
    unknown = "ml_" + "u" * 43
    assert await asyncio.gather(*(cached.authenticate(unknown) for _ in range(10))) == [None] * 10
    assert counted.reads == 1
    clock.now += 4.9
    assert await cached.authenticate(unknown) is None
    assert counted.reads == 1
    clock.now += 0.2
    assert await cached.authenticate(unknown) is None
    assert counted.reads == 2
    # A key revoked elsewhere: refused within the TTL, then from memory as an unknown one.
    assert await cached.authenticate(key) == tenant
    [listed] = await elsewhere.list_keys(tenant.tenant_id)
    assert await elsewhere.revoke_key(listed.key_id)
    clock.now += 5.1
    reads = counted.reads
    assert await cached.authenticate(key) is None
    assert await cached.authenticate(key) is None
    assert counted.reads == reads + 1
    # The memory is bounded: past max_entries the oldest unknown key is read again.
    for letter in "abc":
        assert await cached.authenticate("ml_" + letter * 43) is None
    reads = counted.reads
    assert await cached.authenticate(key) is None
    assert counted.reads == reads + 1
