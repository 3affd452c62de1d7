"""Inbound webhooks: a tenant's URL that starts one workflow per signed delivery.

A webhook's id is a random uuid4 and its URL is public; what authenticates a delivery is the
HMAC signature made with the webhook's secret (see :mod:`moorline.api.routes.webhooks`). The
secret is stored as given because verification needs it.
"""

import builtins
import uuid

from sqlalchemy import RowMapping, delete, insert, select
from sqlalchemy.exc import IntegrityError

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.records import Webhook
from moorline.db.schema import webhooks
from moorline.errors import TenantNotFound
from moorline.types import TenantId


class WebhooksRepo:
    """Creates and finds webhooks."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._backend: Backend = db.backend

    async def create(self, tenant_id: TenantId, workflow: str, secret: str) -> Webhook:
        """Register a webhook of ``tenant_id`` that starts ``workflow``.

        Not retried on a lost connection: a retry after a lost acknowledgement would register
        a second webhook under another id.

        Raises:
            TenantNotFound: No such tenant; nothing was written.
        """
        webhook_id = str(uuid.uuid4())
        async with self._db.transaction() as conn:
            try:
                await conn.execute(
                    insert(webhooks).values(
                        id=webhook_id,
                        tenant_id=tenant_id,
                        workflow=workflow,
                        secret=secret,
                        created_at=self._backend.now(),
                    )
                )
            except IntegrityError as exc:
                # A fresh uuid4 cannot collide; the foreign key to the tenant can fail.
                raise TenantNotFound(f"no tenant {tenant_id}") from exc
            row = (
                (await conn.execute(select(webhooks).where(webhooks.c.id == webhook_id)))
                .mappings()
                .one()
            )
        return _webhook_from_row(row)

    async def get(self, webhook_id: str) -> Webhook | None:
        """The webhook with this id, or None."""
        stmt = select(webhooks).where(webhooks.c.id == webhook_id)

        async def read() -> Webhook | None:
            async with self._db.connect() as conn:
                row = (await conn.execute(stmt)).mappings().first()
            # MariaDB's binary collation still ignores trailing spaces: compare exactly here.
            return None if row is None or row["id"] != webhook_id else _webhook_from_row(row)

        return await self._db.with_retry(read)

    async def list_for(self, tenant_id: TenantId) -> builtins.list[Webhook]:
        """The tenant's webhooks, oldest first."""
        stmt = (
            select(webhooks)
            .where(webhooks.c.tenant_id == tenant_id)
            .order_by(webhooks.c.created_at, webhooks.c.id)
        )

        async def read() -> builtins.list[Webhook]:
            async with self._db.connect() as conn:
                rows = (await conn.execute(stmt)).mappings().all()
            return [_webhook_from_row(row) for row in rows]

        return await self._db.with_retry(read)

    async def delete(self, webhook_id: str, *, tenant_id: TenantId) -> bool:
        """Delete a webhook of ``tenant_id``; False when it has none with this id.

        Deliveries to it are refused (404) from then on; runs it started are kept.
        """
        stmt = delete(webhooks).where(
            webhooks.c.id == webhook_id, webhooks.c.tenant_id == tenant_id
        )

        async def remove() -> bool:
            async with self._db.transaction() as conn:
                result = await conn.execute(stmt)
            return result.rowcount == 1

        # Idempotent: a retry after a lost acknowledgement deletes nothing more.
        return await self._db.with_retry(remove)


def _webhook_from_row(row: RowMapping) -> Webhook:
    return Webhook(
        webhook_id=row["id"],
        tenant_id=TenantId(row["tenant_id"]),
        workflow=row["workflow"],
        secret=row["secret"],
        created_at=row["created_at"],
    )
