"""Database URLs: driver detection, the DSN query whitelist, and primary-first failover.

PostgreSQL and MySQL connections are opened by :func:`make_failover_creator` through
SQLAlchemy's ``async_creator`` hook, which bypasses the dialect's own URL translation and calls
``asyncpg.connect`` / ``aiomysql.connect`` (as :func:`moorline.db.mysql_driver.connect`)
directly. Those signatures take no arbitrary keyword arguments, so every query key is checked
against a whitelist and converted to the driver's type here, at start: a typo fails at once
instead of at the first failover (seed 000).

The whitelist (anything else is a :class:`~moorline.errors.ConfigError` naming the key):

==========================  ==========  ====================================================
key                         driver      becomes
==========================  ==========  ====================================================
``ssl_ca/ssl_cert/ssl_key`` both        one verifying ``ssl.SSLContext`` passed as ``ssl=``
``sslmode``                 PostgreSQL  ``ssl=`` mode string (never mixed with ``ssl_*``)
``command_timeout``         PostgreSQL  float seconds, > 0
``application_name``        PostgreSQL  ``server_settings={"application_name": ...}``
``charset``                 MySQL       str (default ``utf8mb4``)
``unix_socket``             MySQL       str; the socket wins over any host
``init_command``            MySQL       str, run on every new connection
``program_name``            MySQL       str
``autocommit``              MySQL       bool from true/false/1/0/yes/no/on/off
==========================  ==========  ====================================================

``autocommit=true`` is accepted as seed 000 lists it, but SQLAlchemy does not turn it off for
a transaction: on such a URL :meth:`DatabaseManager.transaction` commits statement by statement
and a rollback undoes nothing.
"""

import asyncio
import logging
import math
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl

from sqlalchemy.engine import URL, make_url

from moorline.errors import BackendUnavailable, ConfigError

logger = logging.getLogger(__name__)

Driver = Literal["sqlite", "postgres", "mysql"]

PROBE_TIMEOUT_S = 5.0
"""Seconds one address may take to accept a connection before the next one is tried."""
UNACKNOWLEDGED_TIMEOUT_S = 10.0
"""``TCP_USER_TIMEOUT`` of every database connection: how long data sent to the server may go
unacknowledged before the kernel closes the connection. Behind a partition that drops packets
(no reset, no FIN) a statement would otherwise wait until TCP gives up, about 15 minutes: the
API would hang instead of answering 503 and a worker's heartbeats would stall. Idle connections
and slow statements are not affected: only data the server's host has not acknowledged counts."""

SSL_FILE_KEYS = ("ssl_ca", "ssl_cert", "ssl_key")
POSTGRES_KEYS = frozenset({"sslmode", "command_timeout", "application_name"})
MYSQL_KEYS = frozenset({"charset", "unix_socket", "init_command", "program_name", "autocommit"})
SSLMODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})

# Keys that look plausible but must not pass, with the reason the error message gives.
REJECTED_KEYS: Mapping[str, str] = {
    "connect_timeout": "is not allowed: the failover path fixes a 5 s probe timeout per address",
    "read_timeout": "is not allowed: aiomysql does not accept it",
    "write_timeout": "is not allowed: aiomysql does not accept it",
}

_BOOL_WORDS: Mapping[str, bool] = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}

_DRIVER_LABELS: Mapping[Driver, str] = {
    "sqlite": "SQLite",
    "postgres": "PostgreSQL",
    "mysql": "MySQL",
}

# ``user:password@`` in a URL that SQLAlchemy could not parse, so cannot mask for us.
# Greedy up to the last "@" of the authority, so an unescaped "@" in the password is masked too.
_USERINFO_PASSWORD = re.compile(r"(://[^/@:]*:)[^/]*@")


class DatabaseUnreachable(BackendUnavailable):
    """No database address accepted a new connection; the message lists each and why.

    It passes through SQLAlchemy's pool unchanged (the dialects wrap only their driver's own
    exception classes), so ``engine.connect()`` raises exactly this.
    """

    def __init__(self, failures: list[tuple[str, str]]) -> None:
        listed = "; ".join(f"{address} ({reason})" for address, reason in failures)
        super().__init__(f"no database address answered: {listed}")
        self.failures = failures


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectTarget:
    """One address to try: the driver and the keyword arguments of its ``connect``."""

    driver: Driver
    kwargs: dict[str, Any] = field(default_factory=dict)
    display: str = ""


def driver_of(url: str) -> Driver:
    """Return the driver family of a SQLAlchemy URL.

    Raises:
        ConfigError: the URL does not parse or names an unsupported backend.
    """
    try:
        backend = make_url(url).get_backend_name()
    except Exception as exc:  # sqlalchemy raises ArgumentError; any parse failure is a config error
        shown = _USERINFO_PASSWORD.sub(r"\1***@", url)
        raise ConfigError(
            f"database URL {shown!r} is not a valid URL: {type(exc).__name__}"
        ) from None
    if backend == "sqlite":
        return "sqlite"
    if backend == "postgresql":
        return "postgres"
    if backend in ("mysql", "mariadb"):
        return "mysql"
    raise ConfigError(f"database URL {hide_password(url)!r}: unsupported backend {backend!r}")


def hide_password(url: str) -> str:
    """Return the URL with its password masked, for logs and error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not parsable by SQLAlchemy: mask the userinfo password by pattern
        return _USERINFO_PASSWORD.sub(r"\1***@", url)


def parse_target(url: str) -> ConnectTarget:
    """Parse a PostgreSQL or MySQL URL into the keyword arguments of its driver's ``connect``.

    Query keys go through the whitelist in this module's docstring and are converted to the
    driver's types; SSL files are read here, so a missing or mismatched file fails at start.

    Raises:
        ConfigError: one line naming the offending key (or the URL) and why.
    """
    driver = driver_of(url)
    display = hide_password(url)
    if driver == "sqlite":
        raise ConfigError(f"database URL {display!r}: SQLite has no failover connect target")
    parsed = make_url(url)
    query = _single_values(url, parsed, display)
    _check_keys(query, driver, display)
    kwargs = _address_kwargs(parsed, driver)
    context = _ssl_context(query, display)
    if context is not None:
        kwargs["ssl"] = context
    if driver == "postgres":
        kwargs.update(_postgres_kwargs(query, display))
    else:
        kwargs.update(_mysql_kwargs(query, display))
    return ConnectTarget(driver=driver, kwargs=kwargs, display=display)


def _key_error(display: str, key: str, why: str) -> ConfigError:
    return ConfigError(f"database URL {display!r}: query key {key!r} {why}")


def _single_values(url: str, parsed: URL, display: str) -> dict[str, str]:
    # make_url drops keys with an empty value; find them in the raw query so that neither an
    # unknown key nor a blank whitelisted one is silently ignored.
    raw_query = url.partition("?")[2]
    for raw_key, raw_value in parse_qsl(raw_query, keep_blank_values=True):
        if raw_value == "":
            raise _key_error(display, raw_key, "has an empty value")
    values: dict[str, str] = {}
    for key, value in parsed.query.items():
        # make_url gives a tuple for a repeated key; which one wins would be a guess.
        if not isinstance(value, str):
            raise _key_error(display, key, "is given more than once")
        values[key] = value
    return values


def _check_keys(query: Mapping[str, str], driver: Driver, display: str) -> None:
    own, other = (
        (POSTGRES_KEYS, MYSQL_KEYS) if driver == "postgres" else (MYSQL_KEYS, POSTGRES_KEYS)
    )
    label = _DRIVER_LABELS[driver]
    for key in query:
        if key in REJECTED_KEYS:
            raise _key_error(display, key, REJECTED_KEYS[key])
        if key in other:
            other_label = _DRIVER_LABELS["mysql" if driver == "postgres" else "postgres"]
            raise _key_error(display, key, f"is {other_label}-only and this is a {label} URL")
        if key not in own and key not in SSL_FILE_KEYS:
            allowed = ", ".join(sorted(own | set(SSL_FILE_KEYS)))
            raise _key_error(display, key, f"is not supported for {label} (allowed: {allowed})")
    if "sslmode" in query:
        mixed = [key for key in SSL_FILE_KEYS if key in query]
        if mixed:
            raise _key_error(
                display,
                "sslmode",
                f"cannot be combined with {', '.join(mixed)}: ambiguous TLS intent; "
                "give either sslmode or the ssl_* files",
            )


def _address_kwargs(parsed: URL, driver: Driver) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if parsed.host:
        kwargs["host"] = parsed.host
    if parsed.port:
        kwargs["port"] = parsed.port
    if parsed.username:
        kwargs["user"] = parsed.username
    if parsed.password:
        kwargs["password"] = parsed.password
    if parsed.database:
        kwargs["database" if driver == "postgres" else "db"] = parsed.database
    return kwargs


def _ssl_context(query: Mapping[str, str], display: str) -> ssl.SSLContext | None:
    """Build the verifying context of ``ssl_ca``/``ssl_cert``/``ssl_key``, if any is given.

    The context always verifies the server (CERT_REQUIRED and the host name): the ``ssl_*``
    keys mean "TLS, checked by Python's ssl module", with the given CA or else the system's.
    There is no downgrade; whoever wants ``prefer``-style semantics uses ``sslmode`` instead.
    """
    ca, cert, key = (query.get(name) for name in SSL_FILE_KEYS)
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        given, missing = ("ssl_cert", "ssl_key") if key is None else ("ssl_key", "ssl_cert")
        raise _key_error(display, given, f"needs {missing} too: a client certificate needs both")
    try:
        context = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise _key_error(display, "ssl_ca", f"cannot be loaded: {exc}") from None
    if cert is not None and key is not None:
        try:
            context.load_cert_chain(certfile=cert, keyfile=key)
        except (OSError, ssl.SSLError) as exc:
            raise _key_error(display, "ssl_cert", f"cannot be loaded with ssl_key: {exc}") from None
    return context


def _postgres_kwargs(query: Mapping[str, str], display: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if "sslmode" in query:
        mode = query["sslmode"]
        if mode not in SSLMODES:
            raise _key_error(
                display, "sslmode", f"is {mode!r}; expected one of {', '.join(sorted(SSLMODES))}"
            )
        kwargs["ssl"] = mode
    if "command_timeout" in query:
        kwargs["command_timeout"] = _positive_float(
            query["command_timeout"], "command_timeout", display
        )
    if "application_name" in query:
        # asyncpg.connect has no application_name parameter; it is a server setting.
        kwargs["server_settings"] = {"application_name": query["application_name"]}
    return kwargs


def _mysql_kwargs(query: Mapping[str, str], display: str) -> dict[str, Any]:
    from pymysql.constants import CLIENT

    kwargs: dict[str, Any] = {
        # Conditional updates rely on rowcount counting *matched* rows, not changed ones.
        "client_flag": CLIENT.FOUND_ROWS | CLIENT.MULTI_RESULTS,
        "charset": query.get("charset", "utf8mb4"),
    }
    for key in ("unix_socket", "init_command", "program_name"):
        if key in query:
            kwargs[key] = query[key]
    if "autocommit" in query:
        word = query["autocommit"].lower()
        if word not in _BOOL_WORDS:
            raise _key_error(
                display,
                "autocommit",
                f"is {query['autocommit']!r}; expected one of true/false/1/0/yes/no/on/off",
            )
        kwargs["autocommit"] = _BOOL_WORDS[word]
    return kwargs


def _positive_float(value: str, key: str, display: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise _key_error(display, key, f"is {value!r}; expected a positive number of seconds")
    return number


def make_failover_creator(
    targets: list[ConnectTarget],
    *,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
    fast_paths: bool = True,
) -> Callable[[], Awaitable[Any]]:
    """Build an ``async_creator`` that tries ``targets`` in their fixed order.

    Every new connection starts again at the primary: there is no rotation and no memory of
    the last address that answered, so the primary is used again as soon as it is back. Each
    address gets ``probe_timeout_s`` to accept; the first that does *and accepts writes* wins:
    a standby or a demoted primary (PostgreSQL ``pg_is_in_recovery()`` or
    ``transaction_read_only``, MySQL ``@@global.read_only``) is skipped, so no write is ever
    sent to a read-only node.

    Args:
        targets: the addresses, primary first, all of one driver.
        probe_timeout_s: how long one address may take before the next is tried.
        fast_paths: MariaDB connections are :mod:`moorline.db.mysql_driver`'s (the setting
            ``fast_paths``), else aiomysql's own.

    Returns:
        A coroutine function returning a driver connection, or raising
        :class:`DatabaseUnreachable` that lists every address and its failure.
    """

    async def create() -> Any:
        failures: list[tuple[str, str]] = []
        for target in targets:
            try:
                # aiomysql's connect_timeout bounds only the TCP open, not the handshake, so
                # a server that accepts and then stalls would hang here without this bound.
                async with asyncio.timeout(probe_timeout_s):
                    connection = await _connect(target, probe_timeout_s, fast_paths)
            except Exception as exc:  # any failure of one address moves on to the next
                failures.append((target.display, _describe(exc, target, probe_timeout_s)))
                continue
            try:
                async with asyncio.timeout(probe_timeout_s):
                    writable = await _is_writable(connection, target.driver)
            except BaseException as exc:
                _discard(connection)
                if not isinstance(exc, Exception):
                    raise  # cancelled: the connection is closed all the same
                failures.append((target.display, _describe(exc, target, probe_timeout_s)))
                continue
            if not writable:
                # A standby, or a primary that was demoted after a failover: writing there
                # would fail at best and fork the data at worst, so the next address is tried.
                _discard(connection)
                failures.append((target.display, "read-only (a standby or a demoted node)"))
                continue
            if failures:
                logger.warning(
                    "database failover: connected to %s after %s",
                    target.display,
                    "; ".join(f"{address} failed ({reason})" for address, reason in failures),
                )
            return connection
        raise DatabaseUnreachable(failures)

    return create


async def _is_writable(connection: Any, driver: Driver) -> bool:
    """Whether the node behind a fresh connection accepts writes (one round trip)."""
    if driver == "postgres":
        read_only = await connection.fetchval(
            "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'"
        )
        return not read_only
    async with connection.cursor() as cursor:
        await cursor.execute("SELECT @@global.read_only")
        (read_only,) = await cursor.fetchone()
    return not read_only


def _discard(connection: Any) -> None:
    """Close a connection the creator will not hand out, at once and without awaiting.

    asyncpg's ``terminate()`` and aiomysql's ``close()`` drop the socket synchronously, so a
    rejected connection is closed even when the creator is being cancelled.
    """
    try:
        if hasattr(connection, "terminate"):
            connection.terminate()
        else:
            connection.close()
    except Exception:  # the connection is being dropped; its close may fail too
        logger.debug("closing a rejected database connection failed", exc_info=True)


async def _connect(target: ConnectTarget, timeout_s: float, fast_paths: bool) -> Any:
    if target.driver == "postgres":
        import asyncpg

        connection = await asyncpg.connect(**target.kwargs, timeout=timeout_s)
        transport = getattr(connection, "_transport", None)
    else:
        from moorline.db import mysql_driver

        connection = await mysql_driver.connect(
            **target.kwargs, connect_timeout=timeout_s, fast=fast_paths
        )
        writer = getattr(connection, "_writer", None)
        transport = None if writer is None else writer.transport
    # Neither driver exposes its socket publicly (fastpaths.PRIVATE_NAMES lists both names); a
    # version without them keeps the public path: a connection without the bound.
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        milliseconds = int(UNACKNOWLEDGED_TIMEOUT_S * 1000)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
    return connection


def _describe(exc: Exception, target: ConnectTarget, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    text = _exception_text(exc)
    # aiomysql hides why it could not connect (refused, unknown host) in __cause__.
    if exc.__cause__ is not None:
        text = f"{text} <- {_exception_text(exc.__cause__)}"
    password = target.kwargs.get("password")
    # Driver messages do not echo the password today; masking it is cheap insurance.
    if password:
        text = text.replace(str(password), "***")
    return text


def _exception_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
