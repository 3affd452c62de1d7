"""Storing new runs: :class:`RunInserts`, the submission side of dispatch.

:meth:`RunInserts.insert_pending` stores runs ``pending`` (admission still has to decide);
:meth:`RunInserts.submit_many` stores them ``queued`` with their ``queued`` events in the same
transaction, the fast path when admission has nothing to say. A batch is all or nothing: on
any error nothing of it is written. A run with a ``conversation_id`` is refused
(:class:`~moorline.errors.ConversationBusy`) while its conversation has an active run
(``pending``, ``queued`` or ``running``): the check and the insert share the transaction (see
:func:`~moorline.db.repos.run_conflicts.check_conversations_txn`).

Times come from the database clock only. An insert reads it once per transaction and binds
the value (rather than calling the SQL function per row), which keeps one clock reading per
batch and lets aiomysql send a batch as one multi-row INSERT. Where the backend can, the
database stamps the rows itself and no reading goes first
(:mod:`~moorline.db.repos.stamped_inserts`): a submission with nothing to check first (no
quota claim, no conversation) is one statement committed alone where the backend has the
capability ``one_statement_submit``, and an INSERT returns the time it stamped where the
backend has a ``stamped_runs_insert``.
"""

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.repos.announcements import Announcement, announce_txn, check_backend
from moorline.db.repos.events import EVENT_QUEUED, append_events_txn
from moorline.db.repos.new_runs import NewRun, row_of
from moorline.db.repos.quotas import QuotaClaim, take_units_txn
from moorline.db.repos.records import NULL_ON_INSERT, Run, run_from_row
from moorline.db.repos.run_conflicts import check_conversations_txn, check_unique_within, explain
from moorline.db.repos.run_reads import RunRepoBase, db_now_txn
from moorline.db.repos.stamped_inserts import (
    UnitsWanted,
    insert_stamped_txn,
    submit_in_one_statement,
)
from moorline.db.schema import runs
from moorline.types import Attempt, JSONObject, RunId, RunStatus, TenantId

_INSERT_RUNS = insert(runs)
"""One statement object for every batch: SQLAlchemy derives its cache key once."""


class RunInserts(RunRepoBase):
    """Stores new runs: ``pending``, ``queued`` with their events, or refused."""

    async def insert_pending(self, new: Sequence[NewRun]) -> list[Run]:
        """Store ``new`` as ``pending`` runs, in one transaction; not claimable yet.

        ``not_before`` is fixed now (database time + each run's ``delay_s``), so a run's delay
        counts from when it was accepted, however long admission takes to enqueue it.

        Returns:
            The runs as stored, in the order given.

        Raises:
            IdempotencyConflict: a run's ``(tenant_id, idempotency_key)`` is already taken, or
                appears twice in ``new``; nothing of the batch was written.
            ConversationBusy: a run's conversation has an active run (or two runs of the
                batch share one); nothing was written.
            NotFound: a run names a tenant that does not exist; nothing was written.
            Conflict: a ``run_id`` given is already taken; nothing was written.
            InvalidInput: an input is not JSON; nothing was written.
        """
        return await self._insert(new, RunStatus.PENDING)

    async def submit_many(
        self,
        new: Sequence[NewRun],
        *,
        quotas: Sequence[QuotaClaim | None] | None = None,
        announcement: Announcement | None = None,
    ) -> list[Run]:
        """Store ``new`` as ``queued`` runs with one ``queued`` event each, in one transaction.

        The same as :meth:`insert_pending` followed by :meth:`enqueue`, in one transaction; the
        rows are inserted ``queued`` directly, since nothing can see them ``pending`` anyway.

        With ``quotas``, a run with a :class:`~moorline.db.repos.quotas.QuotaClaim` is queued
        only if it gets a unit of its tenant's daily quota, taken in the same transaction
        (:func:`~moorline.db.repos.quotas.take_units_txn`; the batch's runs in the order
        given); one that gets none is stored ``rate_limited`` with the claim's ``refusal`` as
        its error, without its idempotency key and without events, as
        :meth:`insert_rate_limited` stores it. Units and runs commit together: a batch that
        fails takes no unit.

        With ``announcement`` (PostgreSQL), the write itself sends the wake-ups of the lanes
        its ``queued`` runs went to, at its commit (:mod:`~moorline.db.repos.announcements`):
        a write that commits has announced them.

        Args:
            new: The runs to store.
            quotas: One claim (or None: no quota to take) per run of ``new``, in its order.
            announcement: The wake-ups for the write to send.

        Returns:
            The runs as stored (``queued``, or ``rate_limited`` when refused by the quota), in
            the order given.

        Raises:
            IdempotencyConflict: as for :meth:`insert_pending`; nothing was written.
            ConversationBusy: as for :meth:`insert_pending`; nothing was written.
            NotFound: as for :meth:`insert_pending`; nothing was written.
            Conflict: as for :meth:`insert_pending`; nothing was written.
            InvalidInput: as for :meth:`insert_pending`; nothing was written.
        """
        if quotas is not None and len(quotas) != len(new):
            raise ValueError(f"{len(quotas)} quota claims for {len(new)} runs")
        check_backend(self._backend, announcement)
        return await self._insert(new, RunStatus.QUEUED, quotas, announcement)

    async def _insert(
        self,
        new: Sequence[NewRun],
        status: RunStatus,
        quotas: Sequence[QuotaClaim | None] | None = None,
        announcement: Announcement | None = None,
    ) -> list[Run]:
        if not new:
            return []
        rows = [row_of(item) for item in new]
        check_unique_within(new, rows)
        ids = [RunId(row["id"]) for row in rows]
        claims = {} if quotas is None else _claims_by_run(ids, new, quotas)
        tries = 0
        # Runs with no conversation to check, and no quota or one counter's units for all, on
        # a backend that can: one statement, committed alone (see submit_in_one_statement).
        units = _units_wanted(claims, len(rows))
        is_one_statement = (
            self._backend.capabilities.one_statement_submit
            and (not claims or units is not None)
            and status is RunStatus.QUEUED
            and all(row["conversation_id"] is None for row in rows)
        )

        async def write() -> list[Run]:
            nonlocal tries
            tries += 1
            try:
                if is_one_statement:
                    made = await submit_in_one_statement(self._db, rows, units, announcement)
                    if made is not None:
                        return made
                # Otherwise the statement wrote nothing: the units were not all there.
                async with self._db.write_transaction() as conn:
                    return await self._insert_txn(conn, rows, status, claims, announcement)
            except IntegrityError as exc:
                # The transaction is rolled back; find out which rule the batch broke.
                return await explain(self._db, exc, new, ids, is_retry=tries > 1)

        # Retried on a lost connection: the run ids are fixed above, so a retry after a commit
        # whose acknowledgement was lost finds them stored (see explain) and stores nothing twice
        # (its units are rolled back with its failed insert).
        return await self._db.with_retry(write)

    async def _insert_txn(
        self,
        conn: AsyncConnection,
        rows: Sequence[dict[str, Any]],
        status: RunStatus,
        claims: dict[str, tuple[TenantId, QuotaClaim]],
        announcement: Announcement | None,
    ) -> list[Run]:
        refusals, now = await self._take_units_txn(conn, claims)
        admitted = [row for row in rows if row["id"] not in refusals]
        await check_conversations_txn(conn, self._backend, admitted)
        if announcement is not None and admitted:
            # Sent at the commit, with the runs, or not at all.
            await announce_txn(conn, self._backend, announcement, (r["lane"] for r in admitted))
        if now is None:
            stamped = self._backend.stamped_runs_insert(conn.dialect)
            if stamped is not None and not refusals:
                return await insert_stamped_txn(self._db, conn, rows, status, stamped)
            now = await db_now_txn(conn, self._backend)
        params = [
            {
                **{key: value for key, value in row.items() if key != "delay_s"},
                "status": status.value,
                # ``now`` itself when no delay: the rows share one object, bound once.
                "not_before": now + timedelta(seconds=row["delay_s"]) if row["delay_s"] else now,
                "created_at": now,
                "updated_at": now,
            }
            # In tenant order: each row's foreign-key check locks its tenant's row (shared), and
            # claims lock tenant rows in id order too, so the two never wait on each other in a
            # cycle on MariaDB.
            for row in sorted(admitted, key=lambda row: (row["tenant_id"], row["id"]))
        ]
        refused = [
            _refused_values(row, refusals[row["id"]], now)
            for row in sorted(rows, key=lambda row: (row["tenant_id"], row["id"]))
            if row["id"] in refusals
        ]
        # Two statements when both kinds are there: one executemany needs one set of columns.
        for values in (params, refused):
            if values:
                await conn.execute(_INSERT_RUNS, values)
        queued_ids = [RunId(row["id"]) for row in admitted]
        if status is RunStatus.QUEUED and queued_ids:
            no_data: JSONObject = {}  # one object for all: its JSON is made once
            queued: list[tuple[RunId, Attempt, str, JSONObject]] = [
                (run_id, Attempt(0), EVENT_QUEUED, no_data) for run_id in queued_ids
            ]
            await append_events_txn(conn, self._backend.name, queued, now=now, new_runs=True)
        # Every column is known here (the times are the database time read above), so the runs
        # are built rather than read back: one round trip less per batch. The contract tests
        # check they equal what a read returns on every backend.
        return _runs_in_order(rows, [*params, *refused])

    async def _take_units_txn(
        self, conn: AsyncConnection, claims: dict[str, tuple[TenantId, QuotaClaim]]
    ) -> tuple[dict[str, JSONObject], datetime | None]:
        """Take the claimed quota units.

        Returns:
            The refusal of each run that got no unit, by run id; and the database's time if a
            quota statement read it (one statement less for the batch).
        """
        groups: dict[tuple[TenantId, str, int], list[str]] = {}
        for run_id, (tenant_id, claim) in claims.items():
            groups.setdefault((tenant_id, claim.day, claim.limit), []).append(run_id)
        refusals: dict[str, JSONObject] = {}
        now: datetime | None = None
        # In (tenant, day) order, so two batches lock the counters they share in one order.
        for (tenant_id, day, limit), run_ids in sorted(groups.items()):
            taken = await take_units_txn(
                conn, self._backend.name, tenant_id, day, limit=limit, wanted=len(run_ids)
            )
            now = now or taken.now
            for run_id in run_ids[taken.units :]:
                refusals[run_id] = claims[run_id][1].refusal
        return refusals, now

    async def insert_rate_limited(self, new: NewRun, error: JSONObject) -> Run:
        """Store ``new`` as refused by admission: ``rate_limited`` (terminal), with ``error``.

        The same outcome as :meth:`insert_pending` followed by :meth:`mark_rate_limited`, in
        one statement, so a crash in between cannot leave a ``pending`` run that nothing
        will ever move. No event is written: the run never started.

        Returns:
            The run as stored.

        Raises:
            IdempotencyConflict: the run's idempotency key is taken; nothing was written.
            NotFound: the tenant does not exist; nothing was written.
            Conflict: the run id is taken; nothing was written.
            InvalidInput: the input is not JSON; nothing was written.
        """
        row = row_of(new)
        del row["delay_s"]  # a refused run is never claimed
        run_id = RunId(row["id"])
        tries = 0

        async def write() -> Run:
            nonlocal tries
            tries += 1
            try:
                async with self._db.write_transaction() as conn:
                    now = await db_now_txn(conn, self._backend)
                    values = {
                        **row,
                        "status": RunStatus.RATE_LIMITED.value,
                        "error": error,
                        "not_before": now,
                        "created_at": now,
                        "updated_at": now,
                        "finished_at": now,
                    }
                    await conn.execute(insert(runs).values(values))
            except IntegrityError as exc:
                [run] = await explain(self._db, exc, [new], [run_id], is_retry=tries > 1)
                return run
            return run_from_row({**NULL_ON_INSERT, **values})

        return await self._db.with_retry(write)


def _units_wanted(
    claims: dict[str, tuple[TenantId, QuotaClaim]], runs_count: int
) -> UnitsWanted | None:
    """The one counter (tenant, day, limit) every run of the batch claims a unit of, or None."""
    counters = {(tenant_id, claim.day, claim.limit) for tenant_id, claim in claims.values()}
    if len(claims) != runs_count or len(counters) != 1:
        return None
    [(tenant_id, day, limit)] = counters
    return UnitsWanted(tenant_id=tenant_id, day=day, limit=limit)


def _claims_by_run(
    ids: Sequence[RunId], new: Sequence[NewRun], quotas: Sequence[QuotaClaim | None]
) -> dict[str, tuple[TenantId, QuotaClaim]]:
    """Each claimed run's tenant and claim, by run id, in the batch's order."""
    return {
        run_id: (item.tenant_id, claim)
        for run_id, item, claim in zip(ids, new, quotas, strict=True)
        if claim is not None
    }


def _refused_values(row: dict[str, Any], error: JSONObject, now: datetime) -> dict[str, Any]:
    """The ``runs`` values of a run the quota refused (see :meth:`RunInserts.submit_many`)."""
    values = {key: value for key, value in row.items() if key != "delay_s"}
    return {
        **values,
        # The key names an accepted trigger: the client may retry with it once the quota resets.
        "idempotency_key": None,
        "status": RunStatus.RATE_LIMITED.value,
        "error": error,
        "not_before": now,
        "created_at": now,
        "updated_at": now,
        "finished_at": now,
    }


def _runs_in_order(rows: Sequence[dict[str, Any]], inserted: Sequence[dict[str, Any]]) -> list[Run]:
    """The runs of ``inserted`` (every non-NULL column's value), in the order of ``rows``."""
    by_id = {values["id"]: run_from_row({**NULL_ON_INSERT, **values}) for values in inserted}
    return [by_id[row["id"]] for row in rows]
