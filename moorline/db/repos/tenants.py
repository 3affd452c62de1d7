"""Tenants and their API keys.

An API key is ``ml_`` followed by 43 URL-safe characters (256 random bits). Only its SHA-256
hex digest is stored, with its first :data:`PREFIX_LENGTH` characters so listings can tell keys
apart; the key itself is returned once, when it is created, and never again. Authentication
hashes the presented key and looks the digest up: the unique index does the comparison, so no
secret is compared in Python and unknown and revoked keys cost the same work.

An API process authenticates every request, so it may keep what a lookup found for a few seconds
(``auth_ttl_s``; the API uses :data:`AUTH_CACHE_TTL_S`), keyed by the digest, never the key. The
staleness bound is the TTL: a key revoked, or a plan changed, through *another* repository (the
CLI, another API process) still authenticates here, under its old plan, for at most that long; a
change made through this repository takes effect here at once (its entries are dropped, and a
lookup that began before the change does not store what it read). Only keys that authenticated
are kept: an unknown or revoked key is looked up every time, so a new key works at once and
unknown and revoked keys still cost the same. The cache is hand-written rather than
:class:`~moorline.concurrency.TTLCache` because that one serves a stale value when a reload
fails or answers nothing, which for credentials would stretch the bound without limit.
"""

import asyncio
import builtins
import hashlib
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import RowMapping, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import ApiKey, Tenant
from moorline.db.schema import NAME, api_keys, tenants
from moorline.errors import Conflict, InvalidInput, NotFound
from moorline.types import TenantId

KEY_PREFIX = "ml_"
"""Every API key starts with this, so scanners can find leaked keys (docs/reliability.md I5)."""

KEY_BYTES = 32
PREFIX_LENGTH = 8
PLAN_LENGTH = 64
DEFAULT_LIST_LIMIT = 100

AUTH_CACHE_TTL_S = 5.0
"""Seconds an API process trusts a key it authenticated: its bound on honouring a key revoked,
or a plan changed, by another process (docs/reliability.md I5 asks for at most 60)."""
AUTH_CACHE_ENTRIES = 10_000
"""Authenticated keys kept at most; beyond that the least recently read is dropped."""


class TenantExists(Conflict):
    """A tenant with this name exists already; nothing was written."""

    code = "tenant_exists"


def new_api_key() -> str:
    """A fresh random API key, in clear."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def hash_api_key(api_key: str) -> str:
    """The SHA-256 hex digest stored for ``api_key``.

    A plain hash is enough: the key has 256 random bits, so it cannot be guessed from its
    digest, and a slow password hash would only make every request slower.
    """
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class _Known:
    """What an authenticated key's lookup found, and until when it is trusted."""

    tenant: Tenant
    key_id: str
    fresh_until: float


class TenantsRepo:
    """Tenants, their plans and their API keys."""

    def __init__(
        self,
        db: DatabaseManager,
        *,
        auth_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Wire the repository to its database.

        Args:
            db: The database.
            auth_ttl_s: Seconds :meth:`authenticate` trusts a key it found (see the module
                docstring); 0 looks every key up.
            clock: Monotonic clock in seconds, replaceable in tests.
        """
        self._db = db
        self._backend: Backend = db.backend
        self._auth_ttl_s = auth_ttl_s
        self._clock = clock
        self._known: dict[str, _Known] = {}
        self._lookups: dict[str, asyncio.Future[_Known | None]] = {}
        # Bumped by every change made here: a lookup that began before it stores nothing.
        self._generation = 0

    async def create(self, name: str, plan: str) -> tuple[Tenant, str]:
        """Create a tenant and its first API key, in one transaction.

        Not retried on a lost connection: a retry after a commit whose acknowledgement was
        lost would find the name taken, and the key, shown only here, would be lost.

        Args:
            name: The tenant's unique name.
            plan: The tenant's plan name.

        Returns:
            The tenant and its API key in clear; the key is not stored and cannot be shown
            again.

        Raises:
            TenantExists: The name is taken; nothing was written.
            InvalidInput: The name or plan is empty or too long.
        """
        _check_text("tenant name", name, NAME)
        _check_text("plan", plan, PLAN_LENGTH)
        tenant_id = TenantId(str(uuid.uuid4()))
        now = self._backend.now()
        async with self._db.transaction() as conn:
            try:
                await conn.execute(
                    insert(tenants).values(
                        id=tenant_id, name=name, plan=plan, created_at=now, updated_at=now
                    )
                )
            except IntegrityError as exc:
                # The id is a fresh uuid4, so the name's unique constraint is the one that
                # can fail; the transaction rolls back as the error leaves it.
                raise TenantExists(f"a tenant named {name!r} exists already") from exc
            _, api_key = await _insert_key_txn(conn, self._backend, tenant_id)
            row = await _select_tenant_txn(conn, tenants.c.id == tenant_id)
        if row is None:  # pragma: no cover - inserted in the same transaction
            raise AssertionError(f"tenant {tenant_id} vanished")
        return _tenant_from_row(row), api_key

    async def create_key(self, tenant_id: TenantId) -> str:
        """Add an API key to a tenant (for rotation); returns it in clear, once.

        Raises:
            NotFound: No such tenant.
        """
        return (await self.issue_key(tenant_id))[1]

    async def issue_key(self, tenant_id: TenantId) -> tuple[ApiKey, str]:
        """Add an API key to a tenant: its listing record, and the key in clear, once.

        Not retried on a lost connection: a retry after a lost acknowledgement would issue a
        second key, and the first one's text would be lost with the answer.

        Raises:
            NotFound: No such tenant.
        """
        async with self._db.transaction() as conn:
            try:
                return await _insert_key_txn(conn, self._backend, tenant_id)
            except IntegrityError as exc:
                # A fresh 256-bit key cannot collide; the foreign key to the tenant can fail.
                raise NotFound(f"no tenant {tenant_id}") from exc

    async def list_keys(self, tenant_id: TenantId) -> builtins.list[ApiKey]:
        """The tenant's API keys (revoked ones too), oldest first, without the keys."""
        stmt = (
            select(api_keys)
            .where(api_keys.c.tenant_id == tenant_id)
            .order_by(api_keys.c.created_at, api_keys.c.id)
        )

        async def read() -> builtins.list[ApiKey]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_api_key_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def revoke_key(self, key_id: str, *, tenant_id: TenantId | None = None) -> bool:
        """Revoke an API key; it stops authenticating at once.

        Args:
            key_id: The key's id (see :meth:`list_keys`).
            tenant_id: When given, only a key of this tenant is revoked (a tenant revoking its
                own key must not reach another tenant's).

        Returns:
            False when there is no such (unrevoked) key.
        """
        conditions = [api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None)]
        if tenant_id is not None:
            conditions.append(api_keys.c.tenant_id == tenant_id)
        stmt = update(api_keys).where(*conditions).values(revoked_at=self._backend.now())

        async def revoke() -> bool:
            async with self._db.transaction() as conn:
                result = await conn.execute(stmt)
            return result.rowcount == 1

        try:
            return await self._db.with_retry(revoke)
        finally:
            # Even when the outcome is unknown (an error): trust nothing read before it.
            self._forget(lambda known: known.key_id == key_id)

    async def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant an unrevoked ``api_key`` belongs to, or None.

        The key is hashed and the digest looked up, whatever its shape: malformed, unknown
        and revoked keys all do the same work and get the same answer. With ``auth_ttl_s``, a
        key found is trusted that long, and concurrent lookups of one key share one read.
        """
        return await self.authenticate_digest(hash_api_key(api_key))

    async def authenticate_digest(self, digest: str) -> Tenant | None:
        """:meth:`authenticate` for a key already hashed (:func:`hash_api_key`)."""
        if self._auth_ttl_s <= 0:
            found = await self._look_up(digest)
            return None if found is None else found.tenant
        known = self._known.get(digest)
        if known is not None and self._clock() < known.fresh_until:
            return known.tenant
        lookup = self._lookups.get(digest)
        if lookup is None:
            lookup = asyncio.ensure_future(self._look_up_and_keep(digest, self._generation))
            self._lookups[digest] = lookup
            lookup.add_done_callback(self._lookup_done(digest))
        # Shielded: a caller that goes away does not cancel the read others wait for.
        found = await asyncio.shield(lookup)
        return None if found is None else found.tenant

    async def _look_up_and_keep(self, digest: str, generation: int) -> _Known | None:
        found = await self._look_up(digest)
        if generation != self._generation:
            return found  # a change made here since the read began: answer, keep nothing
        self._known.pop(digest, None)
        if found is not None:
            self._known[digest] = found
            if len(self._known) > AUTH_CACHE_ENTRIES:
                del self._known[next(iter(self._known))]
        return found

    def _lookup_done(self, digest: str) -> Callable[[asyncio.Future[_Known | None]], None]:
        def done(lookup: asyncio.Future[_Known | None]) -> None:
            if self._lookups.get(digest) is lookup:
                del self._lookups[digest]
            if not lookup.cancelled():
                lookup.exception()  # retrieved: every waiter may have gone away

        return done

    async def _look_up(self, digest: str) -> _Known | None:
        stmt = (
            select(tenants, api_keys.c.id.label("key_id"))
            .join(api_keys, api_keys.c.tenant_id == tenants.c.id)
            .where(api_keys.c.key_hash == digest, api_keys.c.revoked_at.is_(None))
        )

        async def read() -> _Known | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).mappings().first()
            if row is None:
                return None
            fresh_until = self._clock() + self._auth_ttl_s
            return _Known(_tenant_from_row(row), row["key_id"], fresh_until)

        return await self._db.with_retry(read)

    def _forget(self, matches: Callable[[_Known], bool]) -> None:
        """Drop the kept keys that ``matches``; lookups already running keep nothing."""
        self._generation += 1
        self._lookups.clear()
        for digest in [digest for digest, known in self._known.items() if matches(known)]:
            del self._known[digest]

    async def get(self, tenant_id: TenantId) -> Tenant | None:
        """The tenant with this id, or None."""

        async def read() -> Tenant | None:
            async with self._db.connect() as conn:
                row = await _select_tenant_txn(conn, tenants.c.id == tenant_id)
            return None if row is None else _tenant_from_row(row)

        return await self._db.with_retry(read)

    async def get_by_name(self, name: str) -> Tenant | None:
        """The tenant with exactly this name, or None.

        Exactly: MySQL/MariaDB's default collation would also match another case or trailing
        spaces, so the row is checked here and every backend answers alike.
        """

        async def read() -> Tenant | None:
            async with self._db.connect() as conn:
                row = await _select_tenant_txn(conn, tenants.c.name == name)
            return None if row is None or row["name"] != name else _tenant_from_row(row)

        return await self._db.with_retry(read)

    async def list(self, limit: int = DEFAULT_LIST_LIMIT, offset: int = 0) -> builtins.list[Tenant]:
        """Tenants, oldest first, ``limit`` from ``offset``."""
        stmt = (
            select(tenants)
            .order_by(tenants.c.created_at, tenants.c.id)
            .limit(max(limit, 0))
            .offset(max(offset, 0))
        )

        async def read() -> builtins.list[Tenant]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_tenant_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def set_plan(self, tenant_id: TenantId, plan: str) -> bool:
        """Move a tenant to another plan; False when there is no such tenant.

        Raises:
            InvalidInput: The plan is empty or too long.
        """
        _check_text("plan", plan, PLAN_LENGTH)
        stmt = (
            update(tenants)
            .where(tenants.c.id == tenant_id)
            .values(plan=plan, updated_at=self._backend.now())
        )

        async def change() -> bool:
            async with self._db.transaction() as conn:
                result = await conn.execute(stmt)
            return result.rowcount == 1

        try:
            return await self._db.with_retry(change)
        finally:
            self._forget(lambda known: known.tenant.tenant_id == tenant_id)


async def _insert_key_txn(
    conn: AsyncConnection, backend: Backend, tenant_id: str
) -> tuple[ApiKey, str]:
    api_key = new_api_key()
    key_id = str(uuid.uuid4())
    await conn.execute(
        insert(api_keys).values(
            id=key_id,
            tenant_id=tenant_id,
            key_hash=hash_api_key(api_key),
            prefix=api_key[:PREFIX_LENGTH],
            created_at=backend.now(),
        )
    )
    # Read back: created_at is the database's clock, set by the statement.
    row = (await conn.execute(select(api_keys).where(api_keys.c.id == key_id))).mappings().one()
    return _api_key_from_row(row), api_key


async def _select_tenant_txn(
    conn: AsyncConnection, condition: ColumnElement[bool]
) -> RowMapping | None:
    return (await conn.execute(select(tenants).where(condition))).mappings().first()


def _check_text(what: str, value: str, max_length: int) -> None:
    if not value.strip():
        raise InvalidInput(f"{what} must not be empty")
    if len(value) > max_length:
        raise InvalidInput(f"{what} is longer than {max_length} characters")


def _tenant_from_row(row: RowMapping) -> Tenant:
    return Tenant(
        tenant_id=TenantId(row["id"]),
        name=row["name"],
        plan=row["plan"],
        created_at=row["created_at"],
    )


def _api_key_from_row(row: RowMapping) -> ApiKey:
    return ApiKey(
        key_id=row["id"],
        tenant_id=TenantId(row["tenant_id"]),
        prefix=row["prefix"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )
