"""Credentials in text: :func:`has_credentials` (refused query strings), :func:`redact` (logs).

Apart from :mod:`moorline.api.guards`, which re-exports both, because it imports nothing of
FastAPI: ``moorline worker`` scrubs its log lines with :func:`redact` and should not pay for
importing the web framework at start-up.
"""

import re
from urllib.parse import parse_qsl

from moorline.db.repos.tenants import KEY_PREFIX

CREDENTIAL_PARAMETERS = frozenset(
    {"api_key", "apikey", "key", "token", "access_token", "auth", "authorization", "admin_token"}
)
"""Query parameters that only ever carry a credential; their presence is refused."""

_KEY = re.compile(r"(?<![A-Za-z0-9])" + re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{32,}")
_CREDENTIAL_ASSIGNMENT = re.compile(
    r"\b(" + "|".join(sorted(CREDENTIAL_PARAMETERS)) + r")=[^&\s\"']+", re.IGNORECASE
)
REDACTED = "[redacted]"


def has_credentials(query_string: str) -> bool:
    """Whether a query string carries an API key or a credential parameter."""
    if _KEY.search(query_string):
        return True
    pairs = parse_qsl(query_string, keep_blank_values=True)
    return any(name.lower() in CREDENTIAL_PARAMETERS or _KEY.search(v) for name, v in pairs)


def redact(text: str) -> str:
    """``text`` with API keys and credential query parameters blanked."""
    text = _KEY.sub(KEY_PREFIX + REDACTED, text)
    return _CREDENTIAL_ASSIGNMENT.sub(lambda match: f"{match.group(1)}={REDACTED}", text)
