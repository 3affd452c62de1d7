"""Logs: run context on every line about a run, text or JSON lines, and no secret in any line.

- **Run context.** :func:`bind_run` sets ``run_id``, ``attempt`` and ``tenant_id`` in a context
  variable where an attempt starts (the worker's execution task). Everything that task logs, and
  every task it creates (cancel watcher, event flushes), inherits them; :class:`RunContext`, a
  handler filter, copies them onto each record that does not already carry them through
  ``extra=``. A context variable rather than a ``LoggerAdapter`` handed around: the lines about a
  run come from the worker, the runner, the engine and the repositories, and threading an
  adapter through all of them would change every signature for a logging concern.
- **Formats.** ``MOORLINE_LOG_FORMAT=text`` (the default) writes
  ``time level logger: message`` followed by ``run_id=… attempt=… tenant_id=…`` when the line is
  about a run; ``json`` writes one JSON object per line with the same fields as keys.
- **Redaction** happens on the formatted line, in :class:`RedactingFormatter`, so a secret in a
  message, an argument, an ``extra`` field or a traceback is caught alike: the values of the
  settings' secrets (admin token, LLM and client API keys), ``Authorization`` header values,
  ``secret=``/``api_key=``-style assignments, and whatever the caller's scrubber recognises (the
  CLI passes :func:`moorline.api.guards.redact`, which knows the tenant key format).
"""

import contextvars
import json
import logging
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TextIO

from moorline.settings import LogFormat, Settings

REDACTED = "[redacted]"
RUN_FIELDS = ("run_id", "attempt", "tenant_id")
"""The record attributes that tie a log line to one attempt of a run."""

_run: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "moorline_log_run", default=None
)

_AUTHORIZATION = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{4,}", re.IGNORECASE)
_SECRET_ASSIGNMENT = re.compile(
    r"\b((?:[a-z_]*_)?(?:secret|token|password|api_key|apikey|authorization))"
    # Not the scheme of an Authorization value: _AUTHORIZATION blanks the credential after it.
    r"([\"']?\s*[:=]\s*[\"']?)(?!(?:Bearer|Basic|Token)\s)([^\s\"'&,}]+)",
    re.IGNORECASE,
)
_SHORTEST_SECRET = 8
"""Secrets shorter than this are not searched for by value: they would blank common words."""

# The standard attributes of every LogRecord: anything else on a record came through ``extra``.
# uvicorn's ``color_message`` repeats the message with terminal colours.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "color_message",
}


@contextmanager
def bind_run(run_id: str, attempt: int, tenant_id: str) -> Iterator[None]:
    """Tag every log line of the current task (and tasks it starts) with this attempt."""
    token = _run.set({"run_id": run_id, "attempt": attempt, "tenant_id": tenant_id})
    try:
        yield
    finally:
        _run.reset(token)


class RunContext(logging.Filter):
    """Copy the bound run's fields onto records that lack them (install it on a handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _run.get()
        if bound is not None:
            for name, value in bound.items():
                if not hasattr(record, name):
                    setattr(record, name, value)
        return True


class RedactingFormatter(logging.Formatter):
    """Formats a record as text, then blanks every secret in the finished line."""

    def __init__(
        self,
        fmt: str | None = None,
        *,
        secrets: Iterable[str] = (),
        scrub: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__(fmt)
        self._secrets = sorted(
            {s for s in secrets if len(s) >= _SHORTEST_SECRET}, key=len, reverse=True
        )
        self._scrub = scrub

    def format(self, record: logging.LogRecord) -> str:
        return self.redact(self.render(record))

    def render(self, record: logging.LogRecord) -> str:
        """The line before redaction: the base format plus the run's fields."""
        line = super().format(record)
        fields = [f"{name}={getattr(record, name)}" for name in RUN_FIELDS if hasattr(record, name)]
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {' '.join(fields)}{newline}{rest}"

    def redact(self, line: str) -> str:
        """``line`` with every secret this formatter knows of blanked."""
        for secret in self._secrets:
            line = line.replace(secret, REDACTED)
        line = _AUTHORIZATION.sub(lambda m: f"{m.group(1)} {REDACTED}", line)
        line = _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", line)
        return self._scrub(line) if self._scrub is not None else line


class JsonFormatter(RedactingFormatter):
    """One JSON object per record: time, level, logger, message, run fields, extras, traceback.

    Each field is redacted before it is encoded: in the encoded line a quote inside a value is
    an escaped quote, which the ``key: value`` patterns would not see through.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": self.redact(record.getMessage()),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD_ATTRIBUTES and not name.startswith("_"):
                entry[name] = value if _is_plain(value) else self.redact(str(value))
        if record.exc_info:
            entry["exception"] = self.redact(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack"] = self.redact(self.formatStack(record.stack_info))
        return json.dumps(entry, ensure_ascii=False)


def _is_plain(value: object) -> bool:
    """A number, a boolean or None: nothing to redact, and JSON keeps its type."""
    return value is None or isinstance(value, bool | int | float)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def make_handler(
    settings: Settings,
    *,
    stream: TextIO | None = None,
    scrub: Callable[[str], str] | None = None,
) -> logging.Handler:
    """A stream handler with the run-context filter and the format ``settings`` asks for.

    Args:
        settings: ``log_format`` picks text or JSON; its secrets are redacted by value.
        stream: Where lines go; default stderr.
        scrub: A further redaction applied to every finished line.
    """
    secrets = [
        secret.get_secret_value()
        for secret in (settings.admin_token, settings.llm_api_key, settings.api_key)
        if secret is not None
    ]
    formatter_class = JsonFormatter if settings.log_format is LogFormat.JSON else RedactingFormatter
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RunContext())
    handler.setFormatter(formatter_class(TEXT_FORMAT, secrets=secrets, scrub=scrub))
    return handler


def configure_logging(settings: Settings, *, scrub: Callable[[str], str] | None = None) -> None:
    """Send ``settings.log_level`` and above, of every logger, through one :func:`make_handler`.

    Replaces the root logger's handlers, so calling it twice does not double the lines.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(make_handler(settings, scrub=scrub))
    root.setLevel(settings.log_level.value)
    # Alembic announces its migration context at INFO whenever the schema version is checked
    # at start; a refused start must stay one line on stderr.
    logging.getLogger("alembic").setLevel(logging.WARNING)
