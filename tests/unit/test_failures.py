"""A failed attempt's stored error: a bounded traceback, secrets blanked (engine/failures.py)."""

from moorline.engine.failures import (
    CUT_MARK,
    MAX_FRAMES,
    MAX_TRACEBACK_CHARS,
    FailureDescriber,
)

TENANT_KEY = "ml_" + "k" * 43


def fail_with(message: str) -> BaseException:
    def innermost() -> None:
        raise RuntimeError(message)

    try:
        innermost()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def recurse(depth: int) -> None:
    if depth == 0:
        raise ValueError("deep")
    recurse(depth - 1)


def test_the_error_keeps_type_message_reason_and_traceback() -> None:
    error = FailureDescriber().describe(fail_with("boom"), reason="retryable")
    assert error["type"] == "RuntimeError"
    assert error["message"] == "boom"
    assert error["reason"] == "retryable"
    trace = error["traceback"]
    assert isinstance(trace, str)
    assert trace.startswith("Traceback (most recent call last):")
    assert "in innermost" in trace and trace.rstrip().endswith("RuntimeError: boom")


def test_only_the_innermost_frames_are_kept() -> None:
    try:
        recurse(3 * MAX_FRAMES)
    except ValueError as exc:
        trace = FailureDescriber().describe(exc, reason="retryable")["traceback"]
    assert isinstance(trace, str)
    # Python prints three identical frames, then "[Previous line repeated N more times]".
    assert f"repeated {MAX_FRAMES - 1 - 3} more times" in trace, trace
    assert "in test_only_the_innermost_frames_are_kept" not in trace  # the outermost frame
    assert trace.rstrip().endswith("ValueError: deep")


def test_a_huge_traceback_is_cut_to_its_end() -> None:
    error = FailureDescriber().describe(fail_with("x" * 50_000), reason="retryable")
    trace = error["traceback"]
    assert isinstance(trace, str)
    assert len(trace) == MAX_TRACEBACK_CHARS
    assert trace.startswith(CUT_MARK) and trace.endswith("x\n")


def test_secrets_are_blanked_in_message_and_traceback() -> None:
    message = (
        f"GET https://llm.example/v1?api_key=sk-live-123456789 failed with key {TENANT_KEY}, "
        "Authorization: Bearer abcdefghijklmnop, token=s3cr3t-value and the-llm-secret-value"
    )
    error = FailureDescriber(secrets=["the-llm-secret-value"]).describe(
        fail_with(message), reason="retryable"
    )
    for field in ("message", "traceback"):
        text = error[field]
        assert isinstance(text, str)
        for secret in (
            "sk-live-123456789",
            TENANT_KEY,
            "abcdefghijklmnop",
            "s3cr3t-value",
            "the-llm-secret-value",
        ):
            assert secret not in text, (field, secret)
        assert "[redacted]" in text
