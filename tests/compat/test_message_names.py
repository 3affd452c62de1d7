"""Persisted and API-visible names of messages, events and conversations are contract."""

from moorline.db.repos.events import EVENT_MESSAGE_RECEIVED, TERMINAL_EVENT_TYPES
from moorline.db.repos.messages import DRAIN_FUNCTION, drain_step_key
from moorline.engine.conversations import parse_holder
from moorline.engine.events import (
    BUFFERED_EVENT_TYPES,
    EVENT_PERMISSION_REQUEST,
    EVENT_PERMISSION_RESOLVED,
    EVENT_STEP_FINISHED,
    EVENT_STEP_STARTED,
    PROGRESS_EVENT_TYPES,
)
from moorline.errors import ConversationBusy, RunNotInteractive
from moorline.types import Attempt, RunId


def test_event_types() -> None:
    assert EVENT_MESSAGE_RECEIVED == "message_received"
    assert TERMINAL_EVENT_TYPES == {"succeeded", "failed", "cancelled", "timed_out"}
    progress = {"step_started", "step_finished", "permission_resolved"}
    assert PROGRESS_EVENT_TYPES == progress
    assert BUFFERED_EVENT_TYPES == {"delta", *progress}
    assert (EVENT_STEP_STARTED, EVENT_STEP_FINISHED) == ("step_started", "step_finished")
    assert EVENT_PERMISSION_REQUEST == "permission_request"
    assert EVENT_PERMISSION_RESOLVED == "permission_resolved"


def test_drain_checkpoints_are_steps_named_by_position() -> None:
    assert drain_step_key(3) == "moorline.drain:3"
    assert DRAIN_FUNCTION == "moorline.drain_messages"


def test_error_codes_match_api_md() -> None:
    assert (ConversationBusy.code, ConversationBusy.status) == ("conversation_busy", 409)
    assert (RunNotInteractive.code, RunNotInteractive.status) == ("run_not_interactive", 409)
    busy = ConversationBusy("chat-1", "run-9")
    assert (busy.conversation_id, busy.active_run_id) == ("chat-1", "run-9")


def test_conversation_lease_holders_name_run_and_attempt() -> None:
    assert parse_holder("0b6f#2") == (RunId("0b6f"), Attempt(2))
    assert parse_holder("with#hash#3") == (RunId("with#hash"), Attempt(3))
    assert parse_holder("no-attempt") is None
    assert parse_holder("#4") is None
