"""The dashboard's API calls with 100,000 runs stored on SQLite: each must answer in < 200 ms.

Fills a fresh SQLite database with ``--runs`` runs of ``--tenants`` tenants (one bulk insert
per chunk: statuses, workflows and lanes mixed as a busy deployment's are, a few running and
queued among many finished), then builds the API app in this process and times, through
``httpx.ASGITransport`` (the full ASGI stack: routing, auth, validation, JSON), each call the
dashboard makes: the runs table's first page, filtered pages (a common and a rare status, a
workflow, a lane, a tenant), a deep cursor page (90% down the listing), a tenant's own listing,
and the lanes and tenants views. Prints the median, min and max of ``--calls`` calls each.

    .venv/bin/python bench/dashboard.py [--runs 100000] [--tenants 20] [--calls 15]
"""

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
from common import on_fresh_database
from sqlalchemy import select

from moorline.api.app import create_app
from moorline.api.routes.runs import encode_cursor
from moorline.db.manager import DatabaseManager
from moorline.db.migrate import upgrade
from moorline.db.repos.listing import RunCursor
from moorline.db.repos.tenants import TenantsRepo
from moorline.db.schema import runs
from moorline.db.types import utcnow
from moorline.engine.registry import Moorline
from moorline.settings import Settings
from moorline.types import RunId, TenantId

ADMIN_TOKEN = "bench-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TARGET_MS = 200.0
CHUNK = 5_000
WORKFLOWS = ("review_pr", "doc_check", "chat_agent", "publish_notes")
LANES = ("workflow_professional", "workflow_team", "workflow_sandbox")
# Finished runs dominate a long-lived database; a few are live.
STATUSES = (("succeeded", 0.86), ("failed", 0.08), ("cancelled", 0.03), ("timed_out", 0.01))
LIVE = (("running", 0.01), ("queued", 0.01))


COLUMNS = (
    "id, tenant_id, workflow, status, lane, priority, attempt, max_attempts, not_before, "
    "input_hash, input, output, created_at, updated_at, started_at, finished_at, elapsed_time, "
    "prompt_tokens, completion_tokens"
)


def stored(at: datetime) -> str:
    """A time as SQLite holds a ``UTCDateTime`` (naive UTC ISO text, which sorts as time)."""
    return at.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")


async def fill(db: DatabaseManager, tenant_ids: list[TenantId], total: int) -> None:
    """Insert ``total`` runs, newest last, a millisecond apart, ``CHUNK`` per transaction.

    The rows go to the driver as prepared tuples (one ``executemany`` per chunk), skipping
    SQLAlchemy's per-row type processing: filling is not what is measured.
    """
    rng = random.Random(7)
    names = [name for name, _ in STATUSES + LIVE]
    weights = [share for _, share in STATUSES + LIVE]
    start = utcnow() - timedelta(milliseconds=total)
    insert_sql = f"INSERT INTO runs ({COLUMNS}) VALUES ({', '.join('?' * 19)})"
    for first in range(0, total, CHUNK):
        rows = []
        for n in range(first, min(total, first + CHUNK)):
            at = start + timedelta(milliseconds=n)
            status = rng.choices(names, weights)[0]
            finished = status not in ("running", "queued")
            rows.append(
                (
                    str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                    rng.choice(tenant_ids),
                    rng.choice(WORKFLOWS),
                    status,
                    rng.choice(LANES),
                    50,
                    0 if status == "queued" else 1,
                    3,
                    stored(at),
                    "0" * 64,
                    json.dumps({"n": n}),
                    json.dumps({"ok": True}) if status == "succeeded" else None,
                    stored(at),
                    stored(at),
                    None if status == "queued" else stored(at),
                    stored(at + timedelta(seconds=2)) if finished else None,
                    2.0 if finished else None,
                    0,
                    0,
                )
            )
        async with db.transaction() as conn:
            await conn.exec_driver_sql(insert_sql, rows)


async def deep_cursor(db: DatabaseManager, depth: int) -> str:
    """The cursor a client holds after paging ``depth`` runs down the admin's listing."""
    stmt = (
        select(runs.c.created_at, runs.c.id)
        .order_by(runs.c.created_at.desc(), runs.c.id.desc())
        .offset(depth - 1)
        .limit(1)
    )
    async with db.connect() as conn:
        row = (await conn.execute(stmt)).one()
    return encode_cursor(RunCursor(created_at=row.created_at, run_id=RunId(row.id)))


async def timed(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], calls: int
) -> list[float]:
    await client.get(path, headers=headers)  # warm the page cache and the statement cache
    spent = []
    for _ in range(calls):
        began = time.perf_counter()
        response = await client.get(path, headers=headers)
        spent.append((time.perf_counter() - began) * 1000)
        assert response.status_code == 200, response.text
    return spent


async def measure(url: str, total: int, tenant_count: int, calls: int) -> bool:
    settings = Settings(database_url=url, admin_token=ADMIN_TOKEN)
    db = DatabaseManager(settings)
    await upgrade(db)
    await db.initialize()
    repo = TenantsRepo(db)
    created = [await repo.create(f"bench-{n}", "team") for n in range(tenant_count)]
    tenant_ids = [tenant.tenant_id for tenant, _ in created]
    began = time.perf_counter()
    await fill(db, tenant_ids, total)
    print(f"stored {total:,} runs of {tenant_count} tenants in {time.perf_counter() - began:.1f} s")
    cursor = await deep_cursor(db, int(total * 0.9))
    own = {"Authorization": f"Bearer {created[0][1]}"}
    app = create_app(settings, db, workflows=Moorline(settings))
    calls_made = [
        ("runs table, first page", "/v1/admin/runs?limit=25", ADMIN),
        ("status=failed (8%)", "/v1/admin/runs?limit=25&status=failed", ADMIN),
        ("status=running (1%)", "/v1/admin/runs?limit=25&status=running", ADMIN),
        ("workflow=doc_check (25%)", "/v1/admin/runs?limit=25&workflow=doc_check", ADMIN),
        ("workflow=unknown (none)", "/v1/admin/runs?limit=25&workflow=unknown", ADMIN),
        ("status=rate_limited (none)", "/v1/admin/runs?limit=25&status=rate_limited", ADMIN),
        ("lane=workflow_sandbox", "/v1/admin/runs?limit=25&lane=workflow_sandbox", ADMIN),
        ("one tenant", f"/v1/admin/runs?limit=25&tenant_id={tenant_ids[1]}", ADMIN),
        (
            f"deep cursor ({int(total * 0.9):,} down)",
            f"/v1/admin/runs?limit=25&cursor={cursor}",
            ADMIN,
        ),
        (
            "deep cursor, status=failed",
            f"/v1/admin/runs?limit=25&status=failed&cursor={cursor}",
            ADMIN,
        ),
        ("tenant key: own runs", "/v1/runs?limit=25", own),
        ("tenant key: own failed runs", "/v1/runs?limit=25&status=failed", own),
        ("lanes (GET /v1/admin/queues)", "/v1/admin/queues", ADMIN),
        ("lanes chart (200 newest)", "/v1/admin/runs?limit=200", ADMIN),
        ("tenants with usage", "/v1/admin/tenants?limit=200", ADMIN),
    ]
    all_fast = True
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://bench") as client,
    ):
        print(f"{'call':<34} {'median ms':>10} {'min':>7} {'max':>7}")
        for label, path, headers in calls_made:
            spent = await timed(client, path, headers, calls)
            median = statistics.median(spent)
            fast = median < TARGET_MS
            all_fast &= fast
            mark = "ok" if fast else f"OVER {TARGET_MS:.0f} ms"
            print(f"{label:<34} {median:>10.1f} {min(spent):>7.1f} {max(spent):>7.1f}  {mark}")
    return all_fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()

    async def work(url: str) -> bool:
        return await measure(url, args.runs, args.tenants, args.calls)

    ok = asyncio.run(on_fresh_database("sqlite", work))
    print(f"every call under {TARGET_MS:.0f} ms (median): {'yes' if ok else 'NO'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
