"""The dashboard in a real browser against a real ``moorline serve --workers 1``.

Playwright drives Debian's ``chromium`` (``/usr/bin/chromium``; ``make test`` and ``.ci/run``
install it through apt when missing), never a downloaded browser. The test signs in as the
admin, creates a tenant in the Tenants page, submits a run over HTTP and watches it appear in
the runs table without a reload, opens it, approves the permission it asks for and sees it
finish with its output and its streamed text; then it signs in with another tenant's key and
finds the run neither in the list nor at its direct URL. A screenshot of each page is saved
under the test's temporary folder, whose path the test prints.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from moorline.db.manager import DatabaseManager
from moorline.db.repos.runs import NewRun, RunsRepo
from moorline.settings import Settings
from moorline.types import TenantId
from tests.integration.test_cli import cli_env, free_port

CHROMIUM = Path("/usr/bin/chromium")
ADMIN_TOKEN = "dashboard-admin-token"
STARTUP_S = 60.0
"""How long ``moorline serve`` may take to answer ``/readyz``: 30 s was once too short on a
loaded, slower CI machine (as long as the soak gives its API)."""
UI_TIMEOUT_MS = 15_000
"""How long a page action or an assertion waits. Generous: on a loaded 2-core CI machine Swagger
UI's bundle alone took more than Playwright's default 5 s to render."""
expect.set_options(timeout=UI_TIMEOUT_MS)  # every module here imports this one

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and os.environ.get("CI") != "true",
    reason="Debian's chromium is not installed (make test installs it)",
)


@dataclass
class Server:
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moorline", "serve", "--port", str(port), "--workers", "1"],
            cwd=tmp_path,
            env=cli_env(
                MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'moorline.db'}",
                MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN,
                MOORLINE_APP="tests.acceptance.app:app",
            ),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        with httpx.Client(base_url=url, timeout=5.0) as client:
            while True:
                assert process.poll() is None, log.read_text()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "moorline serve did not become ready"
                time.sleep(0.05)
        yield Server(url=url, log=log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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


async def sign_in(page: Page, token: str) -> None:
    await page.fill("#token", token)
    await page.click("button[type=submit]")
    await expect(page.locator("#who")).to_contain_text("signed in as")


async def test_sign_in_watch_approve_and_isolate(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(UI_TIMEOUT_MS)
    failures: list[str] = []
    page.on("pageerror", lambda error: failures.append(str(error)))

    # A wrong token is refused on the sign-in screen.
    await page.goto(server.url + "/")
    await page.fill("#token", "not-a-token")
    await page.click("button[type=submit]")
    await expect(page.locator(".signin .error")).to_contain_text("neither the admin token")
    await expect(page.locator("#nav")).to_be_hidden()
    await page.screenshot(path=shots / "0-sign-in.png")

    # The admin signs in and creates tenant A in the Tenants page; its key is shown once.
    await sign_in(page, ADMIN_TOKEN)
    await expect(page.locator("#nav a[data-page=lanes]")).to_have_class("active")
    await page.click("#nav a[data-page=tenants]")
    name = f"acme-{uuid.uuid4().hex[:6]}"
    await page.fill("#tenant-name", name)
    await page.fill("#tenant-plan", "team")
    await page.click("#tenants ~ form button[type=submit]")
    key_a = (await page.locator("#new-key").inner_text()).strip()
    assert key_a.startswith("ml_")
    tenant_row = page.locator("#tenants-body tr", has_text=name)
    await expect(tenant_row).to_contain_text("team")

    # The runs table shows a run submitted over HTTP without a reload.
    await page.click("#nav a[data-page=runs]")
    await expect(page.locator("#runs-note")).to_contain_text(" on this page")
    async with httpx.AsyncClient(base_url=server.url) as client:
        submitted = await client.post(
            "/v1/workflows/publish_notes/runs",
            json={"input": {"topic": "v2.3"}},
            headers={"Authorization": f"Bearer {key_a}"},
        )
        assert submitted.status_code == 202, submitted.text
        run_id = submitted.json()["run_id"]
        b = await client.post(
            "/v1/admin/tenants",
            json={"name": f"other-{uuid.uuid4().hex[:6]}", "plan": "team"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        key_b = b.json()["api_key"]
    row = page.locator(f"#runs-body tr[data-run-id='{run_id}']")
    await expect(row).to_contain_text("publish_notes")

    # The run pauses on its permission request: approve it and watch it finish.
    await row.click()
    await expect(page.locator("#approve")).to_be_visible()
    await expect(page.locator("#interrupt")).to_contain_text("publish")
    await expect(page.locator("#streamed")).to_contain_text("Release notes for v2.3")
    await page.screenshot(path=shots / "3-run-waiting.png", full_page=True)
    await page.click("#approve")
    await expect(page.locator("h1 .badge")).to_have_text("succeeded")
    await expect(page.locator("#result")).to_contain_text('"receipt": "published v2.3"')
    await expect(page.locator("#events [data-type=delta]")).to_have_count(8)
    await expect(page.locator("#events [data-type=succeeded]")).to_have_count(1)
    await expect(page.locator("#steps .step")).to_have_count(2)
    await expect(page.locator("[data-fact=tokens]")).to_contain_text("120 prompt + 30 completion")
    await expect(page.locator("#cancel")).to_be_disabled()
    await page.screenshot(path=shots / "3-run.png", full_page=True)

    # The other pages, after the run: its row, the lane's finished count, the tenant's quota.
    await page.click("#nav a[data-page=runs]")
    await expect(row.locator(".badge")).to_have_text("succeeded")
    await page.screenshot(path=shots / "2-runs.png", full_page=True)
    await page.click("#nav a[data-page=lanes]")
    finished = page.locator("[data-lane=workflow_team] svg text.total")
    await expect(finished).to_contain_text("1 finished")
    await page.screenshot(path=shots / "1-lanes.png", full_page=True)
    await page.click("#nav a[data-page=tenants]")
    await expect(tenant_row).to_contain_text("1 / 500")
    await expect(tenant_row.locator("td").nth(8)).to_have_text("150")
    await page.screenshot(path=shots / "4-tenants.png", full_page=True)

    # Tenant B sees nothing of A's run: not listed, and 404 at its direct URL.
    await page.click("#sign-out")
    await sign_in(page, key_b)
    await expect(page.locator("#nav a[data-page=lanes]")).to_be_hidden()
    await expect(page.locator("#runs-body")).to_contain_text("No runs.")
    assert run_id[-8:] not in await page.content()  # its short id, as a listing shows it
    await page.screenshot(path=shots / "5-other-tenant-runs.png", full_page=True)
    await page.goto(f"{server.url}/#/runs/{run_id}")
    await expect(page.locator("#not-found")).to_contain_text(f"no run {run_id}")
    await expect(page.locator("#approve")).to_have_count(0)
    await page.screenshot(path=shots / "6-other-tenant-run.png", full_page=True)
    assert not failures, failures


async def test_the_lanes_page_flags_runs_no_live_worker_serves(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    """A run of a workflow the serving app lacks (a rolling deploy) waits and is named."""
    async with httpx.AsyncClient(base_url=server.url) as client:
        created = await client.post(
            "/v1/admin/tenants",
            json={"name": f"deploy-{uuid.uuid4().hex[:6]}", "plan": "team"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert created.status_code == 201, created.text
    # Stored as an older app's API would have: this server's app has no such workflow.
    db = DatabaseManager(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'moorline.db'}"))
    try:
        [stored] = await RunsRepo(db).submit_many(
            [
                NewRun(
                    tenant_id=TenantId(created.json()["tenant_id"]),
                    workflow="retired_workflow",
                    input={},
                    lane="workflow_team",
                )
            ]
        )
    finally:
        await db.dispose()
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(UI_TIMEOUT_MS)
    await page.goto(server.url + "/")
    await sign_in(page, ADMIN_TOKEN)
    card = page.locator("[data-lane=workflow_team] .unserved")
    await expect(card).to_contain_text("1 unserved")
    await expect(card).to_contain_text("no live worker serves retired_workflow")
    await page.screenshot(path=tmp_path / "lanes-unserved.png", full_page=True)
    # The live worker passed over it: still queued, never claimed.
    async with httpx.AsyncClient(base_url=server.url) as client:
        run = await client.get(
            f"/v1/admin/runs/{stored.run_id}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
    assert (run.json()["status"], run.json()["attempt"]) == ("queued", 0)
