"""What a submission of a run carries: :class:`NewRun`, its input's hash, its fixed columns."""

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import uuid_utils

from moorline.errors import InvalidInput
from moorline.types import JSONObject, JSONValue, RunId, TenantId

DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class NewRun:
    """A run to store: what the trigger asked for, routed to a lane by the tenant's plan.

    Attributes:
        tenant_id: The owner.
        workflow: The registered workflow's name.
        input: The workflow's JSON arguments (already validated against its parameters).
        lane: The queue the run goes to (the plan's lane).
        priority: Higher is claimed first within a lane (the plan's priority).
        max_attempts: Claims the run may have before it ends ``failed``.
        idempotency_key: Unique per tenant when set: a second run with it is refused.
        conversation_id: The conversation the run belongs to, if any.
        timeout_s: Hard time limit of the run in seconds; None for the workflow's default.
        delay_s: Seconds after the database's current time before the run may be claimed.
        run_id: The id to store it under; :func:`new_run_id` when None.
        rerun_of: The run whose input this one re-runs, if any.
        trace_context: The W3C trace context the worker's spans join (tracing on), if any.
    """

    tenant_id: TenantId
    workflow: str
    input: JSONObject
    lane: str
    priority: int = 0
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    idempotency_key: str | None = None
    conversation_id: str | None = None
    timeout_s: float | None = None
    delay_s: float = 0.0
    run_id: RunId | None = None
    rerun_of: RunId | None = None
    trace_context: JSONObject | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s}")
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")


def new_run_id() -> RunId:
    """A new run's id: a UUIDv7, in text (RFC 9562: 48 bits of milliseconds, then random).

    Ids that grow with time put each new run at the end of every index keyed by its id (the
    run's primary key, its events', its steps'), where a random uuid4 lands anywhere: a batch
    of a thousand uuid4 runs dirtied a page per run in each of those b-trees, and every one of
    them was written to the log at commit. 74 random bits remain, so an id is still not
    guessable; what it tells besides is the run's creation time, which its holder can read.
    """
    return RunId(str(uuid_utils.uuid7()))


def hash_input(value: JSONValue) -> str:
    """SHA-256 hex of the canonical JSON of ``value`` (sorted keys, no spaces, UTF-8).

    Two inputs that differ only in key order or whitespace hash alike, so an idempotent
    resubmission is recognised however its client serialised it.

    Raises:
        InvalidInput: ``value`` is not JSON (NaN or infinity, a non-string key, an object).
    """
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"run input is not JSON: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def row_of(new: NewRun) -> dict[str, Any]:
    """The ``runs`` columns of ``new`` that do not depend on the transaction, plus its delay."""
    return {
        "id": new.run_id if new.run_id is not None else new_run_id(),
        "tenant_id": new.tenant_id,
        "workflow": new.workflow,
        "lane": new.lane,
        "priority": new.priority,
        "attempt": 0,
        "max_attempts": new.max_attempts,
        "idempotency_key": new.idempotency_key,
        "input_hash": hash_input(new.input),
        "conversation_id": new.conversation_id,
        "input": new.input,
        "timeout_s": new.timeout_s,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "rerun_of": new.rerun_of,
        "trace_context": new.trace_context,
        "delay_s": new.delay_s,
    }
