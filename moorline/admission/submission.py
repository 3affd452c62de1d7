"""A submission's way into admission, shared by every surface that starts runs.

``POST /v1/workflows/{workflow}/runs``, its batch form and ``app.submit`` /
``app.submit_many`` all come here: :func:`admit_submission` finds the workflow in the app's
registry and hands :meth:`~moorline.admission.admit.Admission.admit` the trigger, so a
submission is refused, stored and answered alike whichever way it came.

The shapes a trigger's fields must have are here too (:data:`IDEMPOTENCY_KEY_PATTERN`,
:data:`CONVERSATION_PATTERN`, :data:`MAX_DELAY_S`): the API's request schemas declare them for
pydantic and the OpenAPI document, and :func:`check_submission` applies them to a submission
made in Python, which no schema has checked.
"""

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moorline.admission.admit import Admission
from moorline.admission.triggers import Admitted, Trigger
from moorline.engine.registry import Moorline
from moorline.engine.submitting import Submission, Submitted
from moorline.errors import InvalidInput, InvalidRequest, MoorlineError
from moorline.plans import Plan
from moorline.types import TenantId

IDEMPOTENCY_KEY_PATTERN = r"^[!-~]+$"
"""Visible ASCII, no spaces: an idempotency key must compare exactly on every database."""

CONVERSATION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$"
"""Conversation ids become Redis key parts: no ``:``, ``{``, ``}``, ``*`` or spaces."""

MAX_KEY_LENGTH = 200
"""Longest idempotency key and conversation id."""

MAX_DELAY_S = 30 * 86400.0
"""Longest delay: thirty days."""

MAX_BATCH = 1_000
"""Most runs in one batch (``POST /v1/workflows/{workflow}/runs/batch``)."""

_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN)
_CONVERSATION = re.compile(CONVERSATION_PATTERN)


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """Who submits: the tenant, its plan, and whose rate-limit window the runs count against.

    Attributes:
        tenant_id: The runs' owner.
        plan: The tenant's plan.
        rate_identity: An API key's digest for HTTP, ``app:<tenant id>`` in process.
    """

    tenant_id: TenantId
    plan: Plan
    rate_identity: str


def check_submission(submission: Submission) -> None:
    """Hold a Python submission to the request schema's rules for the same fields.

    Raises:
        InvalidInput: the input is not a mapping of the workflow's arguments.
        InvalidRequest: naming the field and the rule it breaks.
    """
    if not isinstance(submission.input, Mapping):
        raise InvalidInput(
            f"input of workflow {submission.workflow!r}: a mapping of its arguments by name, "
            f"not {type(submission.input).__name__}"
        )
    key = submission.idempotency_key
    if key is not None and not (len(key) <= MAX_KEY_LENGTH and _KEY.match(key)):
        raise InvalidRequest(
            f"idempotency_key: 1 to {MAX_KEY_LENGTH} visible ASCII characters, no spaces"
        )
    conversation = submission.conversation_id
    if conversation is not None and not (
        len(conversation) <= MAX_KEY_LENGTH and _CONVERSATION.match(conversation)
    ):
        raise InvalidRequest(
            f"conversation_id: 1 to {MAX_KEY_LENGTH} letters, digits, '_', '.', '@' or '-', "
            "starting with a letter or digit"
        )
    delay = submission.delay
    if (
        isinstance(delay, bool)
        or not isinstance(delay, int | float)
        or not (math.isfinite(delay) and 0 <= delay <= MAX_DELAY_S)
    ):
        raise InvalidRequest(f"delay: seconds from 0 to {MAX_DELAY_S:.0f}")


def trigger_of(workflows: Moorline, origin: Origin, submission: Submission) -> Trigger:
    """The trigger ``submission`` of ``origin``'s tenant makes.

    Raises:
        WorkflowNotFound: no workflow of that name in ``workflows``; nothing was counted.
    """
    return Trigger(
        tenant_id=origin.tenant_id,
        plan=origin.plan,
        rate_identity=origin.rate_identity,
        workflow=workflows.get(submission.workflow),
        input=submission.input,
        idempotency_key=submission.idempotency_key,
        conversation_id=submission.conversation_id,
        delay_s=float(submission.delay),
    )


async def admit_submission(
    admission: Admission, workflows: Moorline, origin: Origin, submission: Submission
) -> Admitted:
    """Admit one submission of ``origin``'s tenant (the steps of :mod:`~.admit`).

    Raises:
        WorkflowNotFound: no workflow of that name in ``workflows``; nothing was counted.
        MoorlineError: :meth:`~moorline.admission.admit.Admission.admit`'s refusals.
    """
    return await admission.admit(trigger_of(workflows, origin, submission))


async def admit_each(
    admission: Admission,
    workflows: Moorline,
    origin: Origin,
    submissions: Sequence[Submission],
    *,
    checked: bool = False,
) -> list[Admitted | MoorlineError]:
    """Admit every submission on its own; each one's run or refusal, in order.

    Through :meth:`~moorline.admission.admit.Admission.admit_many`: submissions that share an
    idempotency key or a conversation are decided in order (the first is admitted, a later one
    gets the first's run, same key, or ``conversation_busy``), the others together, their runs
    stored in a few transactions. An error that is not a refusal (a bug) is raised, after the
    others have been decided.

    Args:
        admission: Decides each submission.
        workflows: The app whose registry names the workflows.
        origin: Who submits them all.
        submissions: The submissions, in order.
        checked: The fields were checked already (by the request schema); else
            :func:`check_submission` checks each.
    """
    answers: list[Admitted | MoorlineError | None] = [None] * len(submissions)
    triggers: list[Trigger] = []
    admitted: list[int] = []
    for index, submission in enumerate(submissions):
        try:
            if not checked:
                check_submission(submission)
            triggers.append(trigger_of(workflows, origin, submission))
        except MoorlineError as exc:
            answers[index] = exc
            continue
        admitted.append(index)
    for index, outcome in zip(admitted, await admission.admit_many(triggers), strict=True):
        answers[index] = outcome
    return answers  # type: ignore[return-value]  # every index was answered


def submitted(admitted: Admitted) -> Submitted:
    """An admitted run as ``app.submit`` returns it."""
    run = admitted.run
    return Submitted(
        run_id=run.run_id,
        created=admitted.created,
        status=run.status,
        workflow=run.workflow,
        queue=run.lane,
        created_at=run.created_at,
    )
