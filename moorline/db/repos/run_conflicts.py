"""The rules a submission of runs can break, and how a broken one is reported.

A batch is refused before anything is written when it collides with itself
(:func:`check_unique_within`) or when a run's conversation has an active run
(:func:`check_conversations_txn`, in the inserting transaction). A batch the database refused
(an ``IntegrityError``) is diagnosed by :func:`explain` from the rows it collided with,
since driver messages differ between drivers and versions.
"""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.backends import Backend
from moorline.db.manager import DatabaseManager
from moorline.db.repos.new_runs import NewRun, hash_input
from moorline.db.repos.records import Run
from moorline.db.repos.run_reads import IN_CHUNK, select_runs_txn
from moorline.db.schema import runs, tenants
from moorline.errors import Conflict, ConversationBusy, IdempotencyConflict, NotFound
from moorline.types import RunId, RunStatus, TenantId

_ACTIVE = (
    RunStatus.PENDING.value,
    RunStatus.QUEUED.value,
    RunStatus.RUNNING.value,
    RunStatus.WAITING.value,
)
"""Statuses of a run that holds its conversation."""


def check_unique_within(new: Sequence[NewRun], rows: Sequence[dict[str, Any]]) -> None:
    """Refuse a batch that collides with itself, before anything is written."""
    keys = [(item.tenant_id, item.idempotency_key) for item in new if item.idempotency_key]
    if len(set(keys)) != len(keys):
        twice = sorted({key for key in keys if keys.count(key) > 1})
        shown = ", ".join(repr(key) for _, key in twice)
        raise IdempotencyConflict(f"idempotency key given twice in one batch: {shown}")
    ids = [row["id"] for row in rows]
    if len(set(ids)) != len(ids):
        raise Conflict("run id given twice in one batch")


def _is_stored_as(
    stored: dict[RunId, Run], new: Sequence[NewRun], ids: Sequence[RunId]
) -> list[bool]:
    return [
        stored[run_id].tenant_id == item.tenant_id
        and stored[run_id].workflow == item.workflow
        and stored[run_id].input_hash == hash_input(item.input)
        for run_id, item in zip(ids, new, strict=True)
    ]


async def check_conversations_txn(
    conn: AsyncConnection, backend: Backend, rows: Sequence[dict[str, Any]]
) -> None:
    """Refuse the batch when a run's conversation has an active run, or two runs share one.

    Where writers take row locks, the tenants' rows are locked first, so two concurrent
    submissions to one conversation are serialised and the second sees the first. The
    batch's own ids are left out of the search: a batch retried after a lost commit
    acknowledgement finds its own runs, and :func:`explain` recognises them.

    Raises:
        ConversationBusy: naming the conversation and its active (or first) run.
    """
    wanted = [
        (row["tenant_id"], row["conversation_id"], row["id"])
        for row in rows
        if row["conversation_id"] is not None
    ]
    if not wanted:
        return
    claimed: dict[tuple[str, str], str] = {}
    for tenant_id, conversation_id, run_id in wanted:
        earlier = claimed.setdefault((tenant_id, conversation_id), run_id)
        if earlier != run_id:
            raise ConversationBusy(conversation_id, earlier)
    if backend.capabilities.row_locks:
        # In id order, like claims, so the two never wait on each other in a cycle.
        tenant_ids = sorted({tenant_id for tenant_id, _, _ in wanted})
        lock = select(tenants.c.id).where(tenants.c.id.in_(tenant_ids)).order_by(tenants.c.id)
        await conn.execute(backend.lock_rows(lock))
    pairs = sorted(claimed)
    own_ids = [row["id"] for row in rows]
    for offset in range(0, len(pairs), IN_CHUNK):
        active = (
            select(runs.c.id, runs.c.conversation_id)
            .where(
                tuple_(runs.c.tenant_id, runs.c.conversation_id).in_(
                    pairs[offset : offset + IN_CHUNK]
                ),
                runs.c.status.in_(_ACTIVE),
                runs.c.id.not_in(own_ids),
            )
            .order_by(runs.c.created_at, runs.c.id)
            .limit(1)
        )
        found = (await conn.execute(active)).first()
        if found is not None:
            raise ConversationBusy(found.conversation_id, found.id)


async def explain(
    db: DatabaseManager,
    exc: IntegrityError,
    new: Sequence[NewRun],
    ids: Sequence[RunId],
    *,
    is_retry: bool,
) -> list[Run]:
    """Turn the integrity error of a rolled-back batch into the error it means.

    Reads the rows the batch collided with instead of parsing driver messages, which
    differ between drivers and versions. A retried batch (the first try's commit was
    acknowledged by nobody) whose every run is already stored as given was committed by
    that first try: its runs are returned.

    Raises:
        IdempotencyConflict: a run's idempotency key is taken.
        Conflict: a run id is taken, or the collision is gone by now.
        NotFound: a run names a tenant that does not exist.
    """
    async with db.connect() as conn:
        stored = await select_runs_txn(conn, ids)
        if is_retry and len(stored) == len(ids) and all(_is_stored_as(stored, new, ids)):
            return [stored[run_id] for run_id in ids]
        keys = [(item.tenant_id, item.idempotency_key) for item in new if item.idempotency_key]
        taken = await _taken_keys_txn(conn, keys)
        if taken:
            shown = ", ".join(repr(key) for _, key in sorted(taken))
            raise IdempotencyConflict(
                f"idempotency key already used by another run of this tenant: {shown}"
            ) from exc
        if stored:
            shown = ", ".join(sorted(stored))
            raise Conflict(f"run id already exists: {shown}") from exc
        tenant_ids = sorted({item.tenant_id for item in new})
        known = set(
            (await conn.execute(select(tenants.c.id).where(tenants.c.id.in_(tenant_ids))))
            .scalars()
            .all()
        )
        unknown = [tenant_id for tenant_id in tenant_ids if tenant_id not in known]
        if unknown:
            raise NotFound(f"no such tenant: {', '.join(unknown)}") from exc
    # A row collided with something it no longer collides with (a run deleted meanwhile,
    # say): report it as a conflict rather than leak the driver's error.
    raise Conflict("the runs could not be stored: a concurrent change conflicted") from exc


async def _taken_keys_txn(
    conn: AsyncConnection, keys: Sequence[tuple[TenantId, str | None]]
) -> set[tuple[str, str]]:
    """Those of ``keys`` (tenant, idempotency key) some stored run already holds."""
    taken: set[tuple[str, str]] = set()
    for tenant_id in sorted({tenant_id for tenant_id, _ in keys}):
        mine = sorted({key for owner, key in keys if owner == tenant_id and key is not None})
        for offset in range(0, len(mine), IN_CHUNK):
            stmt = select(runs.c.tenant_id, runs.c.idempotency_key).where(
                runs.c.tenant_id == tenant_id,
                runs.c.idempotency_key.in_(mine[offset : offset + IN_CHUNK]),
            )
            taken.update((row.tenant_id, row.idempotency_key) for row in await conn.execute(stmt))
    return taken
