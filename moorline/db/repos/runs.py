"""The run-writing side of dispatch: :class:`RunsRepo`, one object over the run modules.

Every method opens its own transaction, and every transition is one conditional statement
whose rowcount (or returned ids) is checked. The work is split by concept:

* :mod:`~moorline.db.repos.run_inserts` — storing new runs (``pending``, ``queued`` with
  their events, or refused by a quota), with :mod:`~moorline.db.repos.stamped_inserts` for the
  backends whose database stamps the rows itself, :mod:`~moorline.db.repos.run_conflicts` for
  the rules a batch can break, and :mod:`~moorline.db.repos.new_runs` for what a submission
  carries;
* :mod:`~moorline.db.repos.run_transitions` — out of ``pending`` (enqueue, refuse) and a
  tenant's cancel;
* :mod:`~moorline.db.repos.run_finishes` — how attempts ended, each under its fence;
* :mod:`~moorline.db.repos.run_retries` — failed and timed-out runs back to ``queued``;
* :mod:`~moorline.db.repos.run_reads` — runs read by id or idempotency key.

The names callers use are importable from here.
"""

from moorline.db.repos.new_runs import DEFAULT_MAX_ATTEMPTS, NewRun, hash_input
from moorline.db.repos.run_finishes import Failed, Outcome, RunFinishes, Stopped, Succeeded
from moorline.db.repos.run_inserts import RunInserts
from moorline.db.repos.run_reads import RunReads
from moorline.db.repos.run_retries import RunRetries
from moorline.db.repos.run_transitions import RunTransitions

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "Failed",
    "NewRun",
    "Outcome",
    "RunsRepo",
    "Stopped",
    "Succeeded",
    "hash_input",
]


class RunsRepo(RunInserts, RunTransitions, RunFinishes, RunRetries, RunReads):
    """Stores runs, moves them out of ``pending``, records how attempts ended, retries runs.

    The union of the concept classes, which share one ``__init__`` (the manager and its
    backend): callers that need one of them may take it alone.
    """
