"""The DSN query whitelist: every accepted key's conversion and every rejection's message."""

import asyncio
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pymysql.constants import CLIENT

from moorline.db.dsn import (
    DatabaseUnreachable,
    driver_of,
    hide_password,
    parse_target,
)
from moorline.db.manager import DatabaseManager
from moorline.errors import BackendUnavailable, ConfigError
from moorline.settings import Settings

PASSWORD = "s3cret-pw"
PG = f"postgresql+asyncpg://moor:{PASSWORD}@db1.example:5433/runs"
MY = f"mysql+aiomysql://moor:{PASSWORD}@db1.example:3307/runs"


def with_query(base: str, **query: str) -> str:
    return base + "?" + "&".join(f"{key}={quote(value, safe='')}" for key, value in query.items())


def config_error(url: str) -> str:
    """The message of the ConfigError ``parse_target(url)`` raises, checked for secrecy."""
    with pytest.raises(ConfigError) as info:
        parse_target(url)
    message = str(info.value)
    assert PASSWORD not in message
    assert "\n" not in message
    return message


# --- TLS material: a throwaway CA, a server and a client certificate --------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stray_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _make_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    *,
    server: bool,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    return key, builder.sign(ca_key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    folder = tmp_path_factory.mktemp("tls")
    ca_key, ca_cert = _make_ca("moorline test CA")
    _, other_ca_cert = _make_ca("some other CA")
    server_key, server_cert = _issue(ca_key, ca_cert, "localhost", server=True)
    client_key, client_cert = _issue(ca_key, ca_cert, "moorline-client", server=False)
    return TlsFiles(
        ca=_write_cert(folder / "ca.pem", ca_cert),
        other_ca=_write_cert(folder / "other-ca.pem", other_ca_cert),
        server_cert=_write_cert(folder / "server.pem", server_cert),
        server_key=_write_key(folder / "server.key", server_key),
        client_cert=_write_cert(folder / "client.pem", client_cert),
        client_key=_write_key(folder / "client.key", client_key),
        stray_key=_write_key(folder / "stray.key", ec.generate_private_key(ec.SECP256R1())),
    )


async def handshake(context: ssl.SSLContext, tls: TlsFiles) -> str:
    """TLS-connect with ``context`` to a local server demanding a client certificate.

    Returns the common name of the client certificate the server received.
    """
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls.ca))
    server_context.verify_mode = ssl.CERT_REQUIRED
    server_context.load_cert_chain(tls.server_cert, tls.server_key)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peercert")
        subject = dict(pair[0] for pair in peer["subject"])
        writer.write(subject["commonName"].encode() + b"\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost"
        )
        try:
            return (await reader.readline()).decode().strip()
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


# --- addresses -----------------------------------------------------------------------------


def test_postgres_address_parts() -> None:
    target = parse_target(PG)
    assert target.driver == "postgres"
    assert target.kwargs == {
        "host": "db1.example",
        "port": 5433,
        "user": "moor",
        "password": PASSWORD,
        "database": "runs",
    }
    assert PASSWORD not in target.display


def test_mysql_address_parts_and_fixed_defaults() -> None:
    target = parse_target(MY)
    assert target.driver == "mysql"
    assert target.kwargs == {
        "host": "db1.example",
        "port": 3307,
        "user": "moor",
        "password": PASSWORD,
        "db": "runs",
        "client_flag": CLIENT.FOUND_ROWS | CLIENT.MULTI_RESULTS,
        "charset": "utf8mb4",
    }
    assert PASSWORD not in target.display


def test_mariadb_scheme_is_mysql() -> None:
    assert parse_target("mariadb+aiomysql://root@127.0.0.1/test").driver == "mysql"


def test_mysql_unix_socket_without_host() -> None:
    target = parse_target("mysql+aiomysql://root@/test?unix_socket=/run/mysqld/mysqld.sock")
    assert "host" not in target.kwargs
    assert target.kwargs["unix_socket"] == "/run/mysqld/mysqld.sock"
    assert target.kwargs["db"] == "test"


def test_sqlite_has_no_connect_target() -> None:
    with pytest.raises(ConfigError, match="SQLite"):
        parse_target("sqlite+aiosqlite:///./x.db")


# --- PostgreSQL conversions ----------------------------------------------------------------


@pytest.mark.parametrize(
    "mode", ["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
)
def test_sslmode_is_passed_as_ssl_string(mode: str) -> None:
    assert parse_target(with_query(PG, sslmode=mode)).kwargs["ssl"] == mode


def test_sslmode_rejects_unknown_mode() -> None:
    message = config_error(with_query(PG, sslmode="sometimes"))
    assert "'sslmode'" in message
    assert "verify-full" in message


def test_command_timeout_becomes_float() -> None:
    value = parse_target(with_query(PG, command_timeout="2.5")).kwargs["command_timeout"]
    assert value == 2.5
    assert isinstance(value, float)
    assert parse_target(with_query(PG, command_timeout="30")).kwargs["command_timeout"] == 30.0


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_command_timeout_must_be_positive_seconds(value: str) -> None:
    assert "'command_timeout'" in config_error(with_query(PG, command_timeout=value))


def test_application_name_goes_into_server_settings() -> None:
    kwargs = parse_target(with_query(PG, application_name="moorline worker")).kwargs
    assert kwargs["server_settings"] == {"application_name": "moorline worker"}
    assert "application_name" not in kwargs


# --- MySQL conversions ---------------------------------------------------------------------


def test_mysql_string_keys_pass_through() -> None:
    url = with_query(
        MY,
        charset="latin1",
        unix_socket="/tmp/my.sock",
        init_command="SET @moorline_probe = 7",
        program_name="moorline",
    )
    kwargs = parse_target(url).kwargs
    assert kwargs["charset"] == "latin1"
    assert kwargs["unix_socket"] == "/tmp/my.sock"
    assert kwargs["init_command"] == "SET @moorline_probe = 7"
    assert kwargs["program_name"] == "moorline"
    assert kwargs["client_flag"] == CLIENT.FOUND_ROWS | CLIENT.MULTI_RESULTS


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("On", True),
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_autocommit_becomes_bool(word: str, expected: bool) -> None:
    assert parse_target(with_query(MY, autocommit=word)).kwargs["autocommit"] is expected


@pytest.mark.parametrize("word", ["maybe", "2", "t", "y"])
def test_autocommit_rejects_other_words(word: str) -> None:
    message = config_error(with_query(MY, autocommit=word))
    assert "'autocommit'" in message
    assert "true/false" in message


# --- ssl_ca / ssl_cert / ssl_key ------------------------------------------------------------


@pytest.mark.parametrize("base", [PG, MY], ids=["postgresql", "mysql"])
def test_ssl_ca_builds_a_verifying_context(base: str, tls: TlsFiles) -> None:
    context = parse_target(with_query(base, ssl_ca=str(tls.ca))).kwargs["ssl"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    loaded = [x509.load_der_x509_certificate(der) for der in context.get_ca_certs(True)]
    assert x509.load_pem_x509_certificate(tls.ca.read_bytes()) in loaded


@pytest.mark.parametrize("base", [PG, MY], ids=["postgresql", "mysql"])
async def test_ssl_files_make_a_context_that_completes_mutual_tls(base: str, tls: TlsFiles) -> None:
    url = with_query(
        base, ssl_ca=str(tls.ca), ssl_cert=str(tls.client_cert), ssl_key=str(tls.client_key)
    )
    context = parse_target(url).kwargs["ssl"]
    assert await handshake(context, tls) == "moorline-client"


async def test_ssl_ca_of_another_authority_refuses_the_server(tls: TlsFiles) -> None:
    url = with_query(
        PG, ssl_ca=str(tls.other_ca), ssl_cert=str(tls.client_cert), ssl_key=str(tls.client_key)
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(parse_target(url).kwargs["ssl"], tls)


def test_ssl_cert_without_key_is_rejected(tls: TlsFiles) -> None:
    message = config_error(with_query(PG, ssl_cert=str(tls.client_cert)))
    assert "'ssl_cert'" in message
    assert "ssl_key" in message


def test_ssl_key_without_cert_is_rejected(tls: TlsFiles) -> None:
    message = config_error(with_query(MY, ssl_key=str(tls.client_key)))
    assert "'ssl_key'" in message
    assert "ssl_cert" in message


def test_missing_ssl_ca_file_is_rejected(tmp_path: Path) -> None:
    assert "'ssl_ca'" in config_error(with_query(PG, ssl_ca=str(tmp_path / "absent.pem")))


def test_key_that_does_not_match_the_cert_is_rejected(tls: TlsFiles) -> None:
    url = with_query(MY, ssl_cert=str(tls.client_cert), ssl_key=str(tls.stray_key))
    assert "'ssl_cert'" in config_error(url)


@pytest.mark.parametrize("ssl_key", ["ssl_ca", "ssl_cert", "ssl_key"])
def test_sslmode_mixed_with_ssl_files_is_rejected(ssl_key: str, tls: TlsFiles) -> None:
    files = {"ssl_ca": tls.ca, "ssl_cert": tls.client_cert, "ssl_key": tls.client_key}
    message = config_error(with_query(PG, sslmode="require", **{ssl_key: str(files[ssl_key])}))
    assert "'sslmode'" in message
    assert ssl_key in message
    assert "ambiguous" in message


# --- rejected keys -------------------------------------------------------------------------


@pytest.mark.parametrize("base", [PG, MY], ids=["postgresql", "mysql"])
@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("connect_timeout", "5 s probe timeout"),
        ("read_timeout", "aiomysql"),
        ("write_timeout", "aiomysql"),
        ("statement_cache_size", "not supported"),
        ("sslmdoe", "not supported"),
    ],
)
def test_rejected_key_is_named_with_its_reason(base: str, key: str, reason: str) -> None:
    message = config_error(with_query(base, **{key: "5"}))
    assert f"'{key}'" in message
    assert reason in message


@pytest.mark.parametrize("key", ["sslmode", "command_timeout", "application_name"])
def test_postgresql_only_key_on_mysql_is_rejected(key: str) -> None:
    message = config_error(with_query(MY, **{key: "require"}))
    assert f"'{key}'" in message
    assert "PostgreSQL-only" in message


@pytest.mark.parametrize(
    "key", ["charset", "unix_socket", "init_command", "program_name", "autocommit"]
)
def test_mysql_only_key_on_postgresql_is_rejected(key: str) -> None:
    message = config_error(with_query(PG, **{key: "on"}))
    assert f"'{key}'" in message
    assert "MySQL-only" in message


def test_repeated_key_is_rejected() -> None:
    assert "'charset'" in config_error(f"{MY}?charset=utf8mb4&charset=latin1")


def test_empty_value_is_rejected() -> None:
    assert "'application_name'" in config_error(f"{PG}?application_name=")


# --- URLs, drivers and the failover error --------------------------------------------------


def test_driver_of_each_backend() -> None:
    assert driver_of("sqlite+aiosqlite:///x.db") == "sqlite"
    assert driver_of(PG) == "postgres"
    assert driver_of(MY) == "mysql"


def test_unsupported_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="oracle") as info:
        driver_of(f"oracle://moor:{PASSWORD}@db1.example/runs")
    assert PASSWORD not in str(info.value)


@pytest.mark.parametrize("password", [PASSWORD, "s3cret@pw"])
def test_unparsable_url_hides_its_password(password: str) -> None:
    url = f"postgresql://moor:{password}@db1.example:port/runs"
    with pytest.raises(ConfigError) as info:
        driver_of(url)
    for secret in (password, *password.split("@")):
        assert secret not in str(info.value)
        assert secret not in hide_password(url)


def test_hide_password_masks_the_password() -> None:
    assert hide_password(PG) == "postgresql+asyncpg://moor:***@db1.example:5433/runs"


def test_all_urls_must_share_one_driver() -> None:
    settings = Settings(database_urls=[PG, MY])
    with pytest.raises(ConfigError, match="mixes database drivers") as info:
        DatabaseManager(settings)
    assert PASSWORD not in str(info.value)


def test_sqlite_cannot_fail_over() -> None:
    settings = Settings(database_urls=["sqlite+aiosqlite:///a.db", "sqlite+aiosqlite:///b.db"])
    with pytest.raises(ConfigError, match="failover"):
        DatabaseManager(settings)


def test_a_bad_key_in_any_failover_url_fails_at_start() -> None:
    settings = Settings(database_urls=[PG, with_query(PG, connect_timeout="3")])
    with pytest.raises(ConfigError, match="'connect_timeout'"):
        DatabaseManager(settings)


def test_unreachable_error_lists_every_address() -> None:
    error = DatabaseUnreachable([("pg://a", "refused"), ("pg://b", "no answer within 5 s")])
    assert isinstance(error, BackendUnavailable)
    assert error.status == 503
    assert str(error) == (
        "no database address answered: pg://a (refused); pg://b (no answer within 5 s)"
    )
