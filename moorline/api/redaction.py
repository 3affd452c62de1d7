"""Credentials in text: :func:`has_credentials` (refused query strings), :func:`redact` (logs).

Apart from :mod:`moorline.api.guards`, which re-exports both, because it imports nothing of
FastAPI: ``moorline worker`` scrubs its log lines with :func:`redact` and should not pay for
importing the web framework at start-up.
"""

import re
from urllib.parse import parse_qsl, unquote

from moorline.db.repos.tenants import KEY_PREFIX

CREDENTIAL_PARAMETERS = frozenset(
    {"api_key", "apikey", "key", "token", "access_token", "auth", "authorization", "admin_token"}
)
"""Query parameters that only ever carry a credential; their presence is refused."""

_KEY = re.compile(r"(?<![A-Za-z0-9])" + re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{32,}")
_CREDENTIAL_ASSIGNMENT = re.compile(
    r"\b(" + "|".join(sorted(CREDENTIAL_PARAMETERS)) + r")=[^&\s\"']+", re.IGNORECASE
)
_PERCENT_ENCODED = re.compile(r"[^\s\"']*%[0-9A-Fa-f]{2}[^\s\"']*")
"""A run of URL-like text with a percent escape, which may hide a key (``ml%5F…``)."""
REDACTED = "[redacted]"


def has_credentials(query_string: str) -> bool:
    """Whether a query string carries an API key or a credential parameter."""
    if _KEY.search(query_string):
        return True
    pairs = parse_qsl(query_string, keep_blank_values=True)
    return any(name.lower() in CREDENTIAL_PARAMETERS or _KEY.search(v) for name, v in pairs)


def redact(text: str) -> str:
    """``text`` with API keys and credential query parameters blanked.

    A percent-encoded key or parameter name (``x=ml%5F…``, ``api%5Fkey=…``) is found in the
    decoded text: its run of text is written decoded, with the credential blanked.
    """
    if "%" in text:
        text = _PERCENT_ENCODED.sub(_redact_decoded, text)
    return _redact_plain(text)


def _redact_plain(text: str) -> str:
    text = _KEY.sub(KEY_PREFIX + REDACTED, text)
    return _CREDENTIAL_ASSIGNMENT.sub(lambda match: f"{match.group(1)}={REDACTED}", text)


def _redact_decoded(match: re.Match[str]) -> str:
    encoded = match.group(0)
    decoded = unquote(encoded)
    blanked = _redact_plain(decoded)
    return encoded if blanked == decoded else blanked
