"""Slot handoff, the worker's side: an outcome committed with its lane's next claim.

When a lane's claim loop waits for a slot (its slots full, or a tenant at its cap held runs
back), a run that ends frees the slot the loop waits for, but only once its outcome commits:
the cap counts ``running`` rows. Through the group commit (:mod:`moorline.worker.completions`)
that is one transaction, then the loop's claim another, one after the other, every turn of
the lane's slots. So the ending run hands its outcome to the loop instead
(:meth:`Handoffs.hand`), the loop takes what was handed (:meth:`Handoffs.take`; runs ending
together are handed together) and writes it with its claim in one transaction
(:meth:`~moorline.db.repos.handoffs.HandoffsRepo.finish_and_claim`). The slots of the runs it
ended are free from that commit: the loop counts them free at once, so the claim fills them.
A run that ends while the loop is in the middle of a claim hands its outcome over too: it goes
with the next claim, together with the others that ended meanwhile.

Each ending run still awaits its own answer (whether its outcome applied), as from the group
commit. Outcomes the loop cannot write that way (the transaction failed, the worker stops)
go through the group commit after all (:meth:`Handoffs.to_completer`), which retries them.
"""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from moorline.concurrency import settle
from moorline.db.repos.runs import Outcome
from moorline.worker.completions import Completer

E = TypeVar("E")


@dataclass(slots=True, eq=False)
class Handed(Generic[E]):
    """An outcome handed to its lane's claim loop, and the execution that ended with it."""

    execution: E
    outcome: Outcome
    answer: "asyncio.Future[bool]" = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Handoffs(Generic[E]):
    """The outcomes waiting for each lane's claim loop (see the module docstring)."""

    def __init__(self, lanes: Sequence[str], completer: Completer) -> None:
        self._waiting: dict[str, list[Handed[E]]] = {lane: [] for lane in lanes}
        self._completer = completer

    def hand(self, lane: str, execution: E, outcome: Outcome) -> "asyncio.Future[bool]":
        """Leave ``outcome`` for ``lane``'s loop; the future says whether it applied."""
        handed = Handed(execution=execution, outcome=outcome)
        self._waiting[lane].append(handed)
        return handed.answer

    def take(self, lane: str) -> list[Handed[E]]:
        """Everything handed to ``lane``'s loop so far; the loop now answers for it."""
        taken, self._waiting[lane] = self._waiting[lane], []
        return taken

    @staticmethod
    def settle(handed: Sequence[Handed[E]], applied: Sequence[bool]) -> None:
        """Answer each handed outcome: whether it applied."""
        for item, ok in zip(handed, applied, strict=True):
            settle(item.answer, ok)

    async def to_completer(self, handed: Sequence[Handed[E]]) -> None:
        """Write ``handed`` through the group commit and answer each with its result."""
        results = await asyncio.gather(
            *(self._completer.complete(item.outcome) for item in handed), return_exceptions=True
        )
        for item, result in zip(handed, results, strict=True):
            settle(item.answer, result)
