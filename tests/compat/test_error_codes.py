"""Error codes are contract (docs/api.md): each class answers with the code and status pinned."""

from moorline import errors
from moorline.db.repos.interrupts import InterruptResolved
from moorline.db.repos.tenants import TenantExists

PINNED: dict[type[errors.MoorlineError], tuple[str, int]] = {
    errors.Unauthorized: ("unauthorized", 401),
    errors.InvalidSignature: ("invalid_signature", 401),
    errors.Forbidden: ("forbidden", 403),
    errors.RunNotFound: ("run_not_found", 404),
    errors.WorkflowNotFound: ("workflow_not_found", 404),
    errors.TenantNotFound: ("tenant_not_found", 404),
    errors.WebhookNotFound: ("webhook_not_found", 404),
    errors.ScheduleNotFound: ("schedule_not_found", 404),
    errors.InterruptNotFound: ("interrupt_not_found", 404),
    errors.ApiKeyNotFound: ("api_key_not_found", 404),
    errors.WorkerNotFound: ("worker_not_found", 404),
    errors.InvalidJson: ("invalid_json", 400),
    errors.CredentialsInQuery: ("key_in_query", 400),
    errors.BodyTooLarge: ("body_too_large", 413),
    errors.InvalidRequest: ("invalid_request", 422),
    errors.InvalidInput: ("invalid_input", 422),
    errors.IdempotencyConflict: ("idempotency_conflict", 409),
    errors.ConversationBusy: ("conversation_busy", 409),
    errors.NoPendingInterrupt: ("no_pending_interrupt", 409),
    InterruptResolved: ("interrupt_resolved", 409),
    TenantExists: ("tenant_exists", 409),
    errors.QuotaExceeded: ("quota_exceeded", 429),
    errors.RateLimited: ("rate_limited", 429),
    errors.BackendUnavailable: ("backend_unavailable", 503),
    errors.HeadersTooLarge: ("headers_too_large", 431),
    errors.RequestTimeout: ("request_timeout", 408),
    errors.ServerBusy: ("server_busy", 503),
    errors.RunNotRetryable: ("run_not_retryable", 409),
    errors.BulkJobNotFound: ("bulk_job_not_found", 404),
    errors.TooManyRuns: ("too_many_runs", 422),
}


def test_error_codes_and_statuses_match_api_md() -> None:
    for error, (code, status) in PINNED.items():
        assert (error.code, error.status) == (code, status), error.__name__


def test_extra_fields_of_error_bodies() -> None:
    assert errors.QuotaExceeded("m", run_id="r", retry_after_s=5).details == {
        "run_id": "r",
        "retry_after_s": 5,
    }
    assert errors.ConversationBusy("c", "r").details == {"run_id": "r"}
    assert errors.RateLimited("m", limit=2, reset_s=1).details == {"retry_after_s": 1}
    assert errors.RunNotFound("m").details == {}
