"""A slot handed on: outcomes and the next claim of their lane, in one transaction.

A tenant's cap counts its ``running`` rows, so a slot a run held is free for the tenant only
once that run's outcome has committed. A worker whose lane waits on freed slots (its tenants
at their caps, or its slots full) would otherwise pay two transactions one after the other
for every turn of its slots: the outcomes' commit, then the claim that may now count them
gone. :meth:`HandoffsRepo.finish_and_claim` writes the outcomes first and claims after them in
the same transaction. The claim's counts see the runs just ended (the transaction's own
writes), so the cap holds exactly as if the two had committed apart, and every lock the two
take is the one each takes alone: the outcomes' run rows first, then, as any claim does, the
tenant rows in id order and the queued runs with ``SKIP LOCKED``. A claimer of the same tenants
elsewhere waits on the tenant locks as it would for a lone claim, and never for the run rows,
which are not queued.

Not retried: a retry after a commit whose acknowledgement was lost would claim a second batch
(the claims' rule, :mod:`moorline.db.repos.claims`). The worker writes the outcomes of a failed
handoff through its group commit instead, which is retried (the outcomes are fenced).
"""

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncConnection

from moorline.db.manager import DatabaseManager
from moorline.db.repos.claims import ClaimBatch, ClaimRequest, ClaimsRepo
from moorline.db.repos.run_finishes import Outcome, RunFinishes


class HandoffsRepo:
    """Outcomes and a claim of their lane in one transaction (see the module docstring)."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._finishes = RunFinishes(db)
        self._claims = ClaimsRepo(db)

    async def finish_and_claim(
        self, outcomes: Sequence[Outcome], request: ClaimRequest
    ) -> tuple[list[bool], ClaimBatch]:
        """Write ``outcomes`` as ``finish_many`` does, then claim as ``request`` asks.

        ``request.limit`` counts the slots of the runs these outcomes end as free.

        Returns:
            Per outcome whether it applied (``finish_many``'s answer), and the claim.
        """
        async with self._db.write_transaction() as conn:
            return await self.finish_and_claim_txn(conn, outcomes, request)

    async def finish_and_claim_txn(
        self, conn: AsyncConnection, outcomes: Sequence[Outcome], request: ClaimRequest
    ) -> tuple[list[bool], ClaimBatch]:
        """:meth:`finish_and_claim` in the caller's write transaction, as its last statements."""
        # The outcomes' lock also sets what the claim's reads need (PostgreSQL's index order):
        # one round trip less a turn.
        applied = await self._finishes.finish_txn(
            conn, outcomes, ends_transaction=False, then_claims=True
        )
        batch = await self._claims.claim_txn(conn, request, in_index_order=bool(outcomes))
        return applied, batch
