"""Input guards and quota arithmetic: pure functions, no I/O."""

import json
from datetime import UTC, datetime

import pytest

from moorline.api.guards import MAX_JSON_DEPTH, parse_json
from moorline.api.redaction import has_credentials, redact
from moorline.dispatch.days import next_reset, quota_day, seconds_until
from moorline.errors import InvalidJson, InvalidRequest

KEY = "ml_" + "Ab9_-" * 8 + "xyz"


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_json_nests_up_to_the_limit_and_no_deeper() -> None:
    assert parse_json(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(InvalidJson, match="deeper than 64"):
        parse_json(nested(MAX_JSON_DEPTH + 1))
    deep_object = b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(InvalidJson, match="deeper than 64"):
        parse_json(deep_object)
    # Far deeper than Python's recursion limit: refused, not a RecursionError.
    with pytest.raises(InvalidJson, match="deeper than 64"):
        parse_json(nested(100_000))


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"\xff", b"NaN", b"[Infinity]", b"[1e999]", b"[" + b"9" * 5000 + b"]"],
    ids=["empty", "truncated", "not-utf8", "nan", "infinity", "overflow", "huge-int"],
)
def test_what_is_not_strict_json_is_invalid_json(body: bytes) -> None:
    with pytest.raises(InvalidJson):
        parse_json(body)


@pytest.mark.parametrize("text", ['"a\\u0000b"', '{"k\\u0000": 1}', '"\\ud800"'])
def test_strings_no_database_can_store_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_json(text.encode())


def test_ordinary_json_comes_back_as_is() -> None:
    value = {"text": "héllo ✓ 😀", "n": [1, 2.5, None, True], "nested": {"k": "v"}}
    assert parse_json(json.dumps(value).encode()) == value


@pytest.mark.parametrize(
    ("query", "refused"),
    [
        ("status=queued&limit=5", False),
        ("workflow=ml_pipeline", False),  # too short to be a key
        (f"x={KEY}", True),
        ("api_key=anything", True),
        ("Token=abc", True),
        ("access_token=", True),
        (f"q=prefix%20{KEY}", True),
    ],
)
def test_credentials_in_query_strings_are_recognised(query: str, refused: bool) -> None:
    assert has_credentials(query) is refused


def test_redaction_blanks_keys_and_credential_parameters() -> None:
    line = f'GET /v1/runs?api_key=secret123&x={KEY} "Bearer {KEY}"'
    blanked = redact(line)
    assert KEY not in blanked and "secret123" not in blanked
    assert "api_key=[redacted]" in blanked and "ml_[redacted]" in blanked


def test_redaction_decodes_percent_encoded_keys_and_names() -> None:
    encoded_key = KEY.replace("_", "%5F", 1)
    for line in (
        f"GET /v1/runs?x={encoded_key} HTTP/1.1",
        f"GET /v1/runs?x=%6D%6C%5F{KEY[3:]} HTTP/1.1",
        f"GET /v1/runs?api%5Fkey={KEY[3:]} HTTP/1.1",
    ):
        blanked = redact(line)
        assert KEY[3:] not in blanked, blanked
        assert blanked.startswith("GET /v1/runs?") and blanked.endswith(" HTTP/1.1")
    harmless = "GET /v1/runs?name=caf%C3%A9 HTTP/1.1"
    assert redact(harmless) == harmless  # nothing to blank: left as it was


def test_the_quota_day_and_its_reset_are_utc() -> None:
    late = datetime.fromisoformat("2030-05-31T23:59:59.200+00:00")
    assert quota_day(late) == "2030-05-31"
    assert next_reset(late) == datetime(2030, 6, 1, tzinfo=UTC)
    assert seconds_until(late, next_reset(late)) == 1
    # 20:00 in New York is already the next UTC day.
    evening = datetime.fromisoformat("2030-05-31T20:00:00-04:00")
    assert quota_day(evening) == "2030-06-01"
    assert seconds_until(evening, next_reset(evening)) == 86400
    assert seconds_until(next_reset(late), next_reset(late)) == 1  # never 0
