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

from collections.abc import Collection, Mapping, Sequence

from moorline.db.manager import DatabaseManager
from moorline.db.repos.claims import ClaimBatch, ClaimsRepo
from moorline.db.repos.run_finishes import Outcome, RunFinishes


class HandoffsRepo:
    """Outcomes and a claim of their lane in one transaction (see the module docstring)."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db
        self._finishes = RunFinishes(db)
        self._claims = ClaimsRepo(db)

    async def finish_and_claim(
        self,
        outcomes: Sequence[Outcome],
        lane: str,
        owner: str,
        *,
        limit: int,
        lease_ttl_s: float,
        tenant_caps: Mapping[str, int],
        default_cap: int = 1,
        workflows: Collection[str] | None = None,
    ) -> tuple[list[bool], ClaimBatch]:
        """Write ``outcomes`` as ``finish_many`` does, then claim up to ``limit`` runs of ``lane``.

        Args:
            outcomes: How attempts ended, each under its fence.
            lane: The lane to claim from; the other arguments are :meth:`ClaimsRepo.claim`'s.
            owner: The claiming worker's lease owner id.
            limit: Most runs to claim: the lane's free slots once these outcomes are written.
            lease_ttl_s: Seconds until a new lease expires without a heartbeat.
            tenant_caps: Plan name → most ``running`` runs of a tenant on that plan.
            default_cap: The cap of a tenant whose plan is not in ``tenant_caps``.
            workflows: The workflows ``owner`` runs; None, every one.

        Returns:
            Per outcome whether it applied (``finish_many``'s answer), and the claim.
        """
        async with self._db.write_transaction() as conn:
            applied = await self._finishes.finish_txn(conn, outcomes, ends_transaction=False)
            batch = await self._claims.claim_txn(
                conn,
                lane,
                owner,
                limit=limit,
                lease_ttl_s=lease_ttl_s,
                tenant_caps=tenant_caps,
                default_cap=default_cap,
                workflows=workflows,
            )
        return applied, batch
