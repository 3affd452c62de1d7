"""What a failed attempt leaves in its run's ``error``: type, message, reason and traceback.

The traceback is what a developer needs to fix a failure without access to the worker's log,
so it is kept, but bounded: the last :data:`MAX_FRAMES` frames (where the error was raised)
and at most :data:`MAX_TRACEBACK_CHARS` characters, the end kept when it is cut. A traceback
repeats whatever text the failing code held (a URL with a token, a header), and the error is
shown to the tenant in the API, the dashboard and the CLI, so both the message and the
traceback go through the log lines' redaction: the configured secrets by value,
``Authorization`` values, ``secret=``-style assignments and tenant API keys.
"""

import re
import traceback
from collections.abc import Iterable

from moorline.db.repos.tenants import KEY_PREFIX
from moorline.observability.logs import REDACTED, RedactingFormatter
from moorline.types import JSONObject

MAX_FRAMES = 20
"""Innermost frames kept: the outer ones are the engine's, the same for every failure."""

MAX_TRACEBACK_CHARS = 4000
"""Longest traceback kept, so one run's error stays a small row and a small response."""

CUT_MARK = "…(traceback cut)\n"

# A tenant key as the API issues them (``moorline.api.redaction`` blanks the same in logs; it
# lives above the engine, so the pattern is rebuilt here from the one prefix they share).
_TENANT_KEY = re.compile(r"(?<![A-Za-z0-9])" + re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{32,}")


class FailureDescriber:
    """Turns a workflow's exception into the run's ``error`` object, secrets blanked.

    Args:
        secrets: Values to blank wherever they appear (the settings' tokens and keys).
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._redactor = RedactingFormatter(secrets=secrets, scrub=_blank_tenant_keys)

    def describe(self, exc: BaseException, *, reason: str) -> JSONObject:
        """``{"type", "message", "reason", "traceback"}`` of ``exc``."""
        return {
            "type": type(exc).__name__,
            "message": self._redactor.redact(str(exc)),
            "reason": reason,
            "traceback": self._redactor.redact(trimmed_traceback(exc)),
        }


def trimmed_traceback(exc: BaseException) -> str:
    """``exc``'s traceback, innermost :data:`MAX_FRAMES` frames, at most the size bound."""
    # A negative limit keeps the innermost frames; chained causes are kept (each bounded).
    text = "".join(traceback.format_exception(exc, limit=-MAX_FRAMES))
    if len(text) <= MAX_TRACEBACK_CHARS:
        return text
    return CUT_MARK + text[-(MAX_TRACEBACK_CHARS - len(CUT_MARK)) :]


def _blank_tenant_keys(text: str) -> str:
    return _TENANT_KEY.sub(REDACTED, text)
