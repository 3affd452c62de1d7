"""MariaDB multi-statements: one code path sends two statements, and no user text can add one.

``mysql_driver.Connection.commit_with_next_statement`` sends a transaction's last statement and
the constant ``; COMMIT`` as one query. Every statement is SQLAlchemy's, its values escaped by
the driver into quoted literals: hostile text (quotes, backslashes, ``;``, comments) sent through
each path that commits with its statement (a submission, a claim, a finish) must stay inside
its literals, so the query is the statement and the suffix, and nothing else runs. Any other
query that returns several results fails, and the public fallback asks for no multi-statements.
"""

import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiomysql
import pytest
from pymysql.constants import CLIENT
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from moorline.db import mysql_driver
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.queue import QueueRepo
from moorline.db.repos.runs import NewRun, RunsRepo, Succeeded
from moorline.db.schema import runs
from moorline.settings import Settings
from tests.contract.queue_helpers import NO_CAP, create_tenant
from tests.servers import MYSQL_ADMIN_URL, require_server, run_sql, unique_name

HOSTILE = "it's \\'; DROP TABLE runs; -- \" ` \u00bf' */ #\n;\\"
LITERALS = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`[^`]*`", re.DOTALL)
"""MariaDB's quoted literals and identifiers, as the driver escapes them (backslashes)."""


def outside_literals(sql: str) -> str:
    return LITERALS.sub("?", sql)


@pytest.fixture(scope="module")
def mysql_url() -> Iterator[str]:
    require_server("mysql")
    name = unique_name()
    run_sql("mysql", f"CREATE DATABASE {name}")
    try:
        yield make_url(MYSQL_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        run_sql("mysql", f"DROP DATABASE IF EXISTS {name}")


@pytest.fixture
async def db(mysql_url: str) -> AsyncIterator[DatabaseManager]:
    manager = DatabaseManager(Settings(database_url=mysql_url, db_retry_base=0.01))
    await upgrade(manager)
    try:
        yield manager
    finally:
        await manager.dispose()


@pytest.fixture
def sent_with_commit(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement sent with its ``; COMMIT``, as the driver sends it."""
    sent: list[str] = []
    query_and_commit = mysql_driver.Connection._query_and_commit

    async def recorded(self: mysql_driver.Connection, sql: Any) -> int:
        sent.append(sql.decode() if isinstance(sql, bytes | bytearray) else sql)
        affected: int = await query_and_commit(self, sql)
        return affected

    monkeypatch.setattr(mysql_driver.Connection, "_query_and_commit", recorded)
    return sent


def assert_one_statement_each(sent: list[str]) -> None:
    assert sent, "no statement was sent with its COMMIT"
    for sql in sent:
        assert ";" not in outside_literals(sql), sql


async def test_hostile_text_stays_in_the_literals_of_every_statement_sent_with_commit(
    db: DatabaseManager, sent_with_commit: list[str]
) -> None:
    tenant = await create_tenant(db)
    new = NewRun(
        tenant_id=tenant,
        workflow=HOSTILE,
        input={HOSTILE: [HOSTILE, {"nested": HOSTILE}]},
        lane="hostile",
        idempotency_key=HOSTILE,
        conversation_id=HOSTILE,
    )
    (stored,) = await RunsRepo(db).submit_many([new])
    assert_one_statement_each(sent_with_commit)
    submitted = len(sent_with_commit)

    batch = await QueueRepo(db).claim(
        "hostile", HOSTILE, limit=1, lease_ttl_s=60, tenant_caps=NO_CAP
    )
    (claim,) = batch.claims
    finished = await RunsRepo(db).finish_many([Succeeded(fence=claim.fence, output=HOSTILE)])
    assert finished == [True]
    assert_one_statement_each(sent_with_commit[submitted:])

    # Every value came back as sent, and the table an injection would drop is there.
    async with db.connect() as conn:
        row = (await conn.execute(select(runs).where(runs.c.id == stored.run_id))).one()
    assert (row.workflow, row.idempotency_key, row.conversation_id) == (HOSTILE,) * 3
    assert row.input == {HOSTILE: [HOSTILE, {"nested": HOSTILE}]}
    assert row.output == HOSTILE
    assert row.status == "succeeded"


async def test_bound_values_cannot_add_a_statement_to_a_commit(
    db: DatabaseManager, sent_with_commit: list[str]
) -> None:
    async with db.transaction() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS probe (v VARCHAR(200))"))
        await conn.execute(text("DELETE FROM probe"))
    for value in (HOSTILE, "'); DROP TABLE probe; --", "\\", "\\'", "';", "x' OR '1'='1"):
        async with db.write_transaction() as conn:
            await db.commit_with_next_statement(conn)
            await conn.execute(text("INSERT INTO probe (v) VALUES (:v)"), {"v": value})
        assert outside_literals(sent_with_commit[-1]) == "INSERT INTO probe (v) VALUES (?)"
    async with db.connect() as conn:
        found = sorted((await conn.execute(text("SELECT v FROM probe"))).scalars())
    assert found == sorted([HOSTILE, "'); DROP TABLE probe; --", "\\", "\\'", "';", "x' OR '1'='1"])


async def test_the_suffix_is_the_only_text_the_driver_adds(
    db: DatabaseManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    queries: list[str] = []
    query = aiomysql.Connection.query

    async def recorded(self: Any, sql: Any, unbuffered: bool = False) -> int:
        queries.append(sql.decode() if isinstance(sql, bytes | bytearray) else sql)
        affected: int = await query(self, sql, unbuffered)
        return affected

    monkeypatch.setattr(aiomysql.Connection, "query", recorded)
    async with db.write_transaction() as conn:
        await db.commit_with_next_statement(conn)
        await conn.execute(text("SELECT :v"), {"v": HOSTILE})
    assert queries[-1].endswith(mysql_driver.COMMIT_SUFFIX)
    assert outside_literals(queries[-1]) == "SELECT ?" + mysql_driver.COMMIT_SUFFIX


async def test_a_query_of_several_statements_elsewhere_fails(db: DatabaseManager) -> None:
    with pytest.raises(ProgrammingError, match="ran several"):
        async with db.connect() as conn:
            await conn.execute(text("SELECT 1; SELECT 2"))
    async with db.connect() as conn:  # the connection is usable again
        assert (await conn.execute(text("SELECT 3"))).scalar_one() == 3


async def test_the_public_fallback_asks_for_no_multi_statements(db: DatabaseManager) -> None:
    connection = await mysql_driver.connect(fast=False, **db.targets[0].kwargs)
    try:
        assert not isinstance(connection, mysql_driver.Connection)
        assert connection.client_flag & CLIENT.MULTI_STATEMENTS == 0
        cursor = await connection.cursor()
        with pytest.raises(Exception, match="1064"):  # a syntax error: one statement only
            await cursor.execute("SELECT 1; SELECT 2")
    finally:
        connection.close()
