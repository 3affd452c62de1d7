"""The Workers page in a real browser: three live worker processes, then one killed (issue 20).

A real ``moorline serve --workers 0`` and three ``moorline worker`` processes share a SQLite
file, with a 3 s lease TTL. Each worker holds one long run. Debian's chromium (as in
``test_dashboard.py``) signs in as the admin and finds the three workers live on the Workers
page with their lane and slots and a link to the run each holds; after ``kill -9`` of one, the
page shows it dead without a reload, within one TTL plus the page's 2 s poll. The worker's own
page lists the run it holds. Screenshots go under the test's temporary folder (path printed).
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, async_playwright, expect

from tests.acceptance.test_dashboard import ADMIN_TOKEN, CHROMIUM, STARTUP_S, UI_TIMEOUT_MS, sign_in
from tests.faults.harness import LANE, LEASE_TTL_S, PLAN, REPO_ROOT, Workers
from tests.helpers import wait_for
from tests.integration.test_cli import free_port

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and os.environ.get("CI") != "true",
    reason="Debian's chromium is not installed (make test installs it)",
)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PAGE_POLL_S = 2.0
"""The dashboard's poll (``POLL_MS`` in app.js): the page shows what the API said then."""


@dataclass
class Deployment:
    url: str
    workers: Workers


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """``moorline serve --workers 0`` and three workers of one slot each, on a SQLite file."""
    workers = Workers(
        f"sqlite+aiosqlite:///{tmp_path / 'moorline.db'}", tmp_path, slots=1, grace_s=0.5
    )
    env = {**workers.env(), "MOORLINE_ADMIN_TOKEN": ADMIN_TOKEN, "MOORLINE_APP": workers.app}
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "moorline", "serve", "--port", str(port), "--workers", "0"],
            cwd=REPO_ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        with httpx.Client(base_url=url, timeout=5.0) as client:
            while True:
                assert server.poll() is None, log.read_text()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "moorline serve did not become ready"
                time.sleep(0.05)
        for _ in range(3):
            workers.start()
        yield Deployment(url=url, workers=workers)
    finally:
        workers.kill_all()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"]
        )
        try:
            yield launched
        finally:
            await launched.close()


async def test_the_workers_page_shows_three_live_workers_then_one_dead(
    deployment: Deployment, browser: Browser, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    pids = {proc.pid for proc in deployment.workers.procs}
    async with httpx.AsyncClient(base_url=deployment.url, headers=ADMIN) as client:
        tenant = await client.post("/v1/admin/tenants", json={"name": "fleet", "plan": PLAN})
        assert tenant.status_code == 201, tenant.text
        key = {"Authorization": f"Bearer {tenant.json()['api_key']}"}
        run_ids = []
        for _ in range(3):
            accepted = await client.post(
                "/v1/workflows/work/runs", json={"input": {"seconds": 120.0}}, headers=key
            )
            assert accepted.status_code == 202, accepted.text
            run_ids.append(accepted.json()["run_id"])

        async def busy() -> dict[int, dict[str, Any]] | None:
            listed = (await client.get("/v1/admin/workers")).json()["workers"]
            ours = {w["pid"]: w for w in listed if w["pid"] in pids}
            return ours if len(ours) == 3 and all(w["runs"] == 1 for w in ours.values()) else None

        found = await wait_for(busy, timeout_s=STARTUP_S * 2, message="three busy workers")
        assert found is not None

    page = await browser.new_page(viewport={"width": 1400, "height": 700})
    page.set_default_timeout(UI_TIMEOUT_MS)
    failures: list[str] = []
    page.on("pageerror", lambda error: failures.append(str(error)))
    await page.goto(deployment.url + "/")
    await sign_in(page, ADMIN_TOKEN)
    await page.click("#nav a[data-page=workers]")
    rows = page.locator("#workers-body tr[data-status=live]")
    await expect(rows).to_have_count(3)
    for worker in found.values():
        row = page.locator(f"#workers-body tr[data-worker-id='{worker['worker_id']}']")
        await expect(row.locator("td.lanes")).to_have_text(f"{LANE}=1")
        [held] = worker["run_ids"]
        await expect(row.locator(f"td.held a[data-run-id='{held}']")).to_have_count(1)
    await page.screenshot(path=shots / "1-workers-live.png", full_page=True)

    victim = deployment.workers.procs[0]
    victim_id = found[victim.pid]["worker_id"]
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait()
    dead_row = page.locator(f"#workers-body tr[data-worker-id='{victim_id}']")
    await expect(dead_row).to_have_attribute(
        "data-status", "dead", timeout=(LEASE_TTL_S + PAGE_POLL_S + 5.0) * 1000
    )
    shown_after_s = time.monotonic() - killed_at
    print(f"page shows the killed worker dead {shown_after_s:.2f}s after kill -9")
    assert shown_after_s <= LEASE_TTL_S + PAGE_POLL_S + 1.0
    await expect(rows).to_have_count(2)
    await page.screenshot(path=shots / "2-workers-one-dead.png", full_page=True)

    # A live worker's page lists the run it holds, linked to the run.
    survivor = found[deployment.workers.procs[1].pid]
    await page.click(f"#workers-body tr[data-worker-id='{survivor['worker_id']}'] td a >> nth=0")
    await expect(page.locator("h1 .badge")).to_have_text("live")
    await expect(
        page.locator(f"#held-body tr[data-run-id='{survivor['run_ids'][0]}']")
    ).to_contain_text("work")
    await expect(page.locator("[data-fact=lanes]")).to_have_text(f"{LANE}=1")
    await page.screenshot(path=shots / "3-worker.png", full_page=True)
    assert not failures, failures
