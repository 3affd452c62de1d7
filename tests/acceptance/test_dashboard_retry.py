"""The run page's Retry and Re-run buttons in a real browser (``moorline serve --workers 1``).

``fail_loudly`` fails at once with a budget of one attempt. The admin opens its failed run:
Retry queues it again (a fresh budget: it fails again on attempt 2, and the page, whose event
stream had closed at the first ``failed``, follows the retry live); Re-run starts a new run
and opens its page, which links back with "Re-run of". Screenshots go under the test's
temporary folder, whose path the test prints.
"""

import uuid
from pathlib import Path

import httpx
from playwright.async_api import Browser, expect

from tests.acceptance import test_dashboard as dashboard
from tests.acceptance.test_dashboard import ADMIN_TOKEN, UI_TIMEOUT_MS, Server, sign_in

# The dashboard test's fixtures and skip condition, found by name.
server = dashboard.server
browser = dashboard.browser
pytestmark = dashboard.pytestmark


async def test_retry_and_rerun_buttons(server: Server, browser: Browser, tmp_path: Path) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=server.url) as client:
        tenant = await client.post(
            "/v1/admin/tenants",
            json={"name": f"t-{uuid.uuid4().hex[:6]}", "plan": "team"},
            headers=admin,
        )
        key = tenant.json()["api_key"]
        started = await client.post(
            "/v1/workflows/fail_loudly/runs", json={}, headers={"Authorization": f"Bearer {key}"}
        )
        run_id = started.json()["run_id"]
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(UI_TIMEOUT_MS)
    failures: list[str] = []
    page.on("pageerror", lambda error: failures.append(str(error)))
    await page.goto(server.url + "/")
    await sign_in(page, ADMIN_TOKEN)
    await page.goto(f"{server.url}/#/runs/{run_id}")
    await expect(page.locator("h1 .badge")).to_have_text("failed")
    await expect(page.locator("#rerun")).to_be_enabled()

    await page.click("#retry")

    await expect(page.locator("#events [data-type=retried]")).to_have_count(1)
    await expect(page.locator("#events [data-type=failed]")).to_have_count(2)  # streamed live
    await expect(page.locator("[data-fact=attempts]")).to_have_text("2")
    await expect(page.locator("#retry")).to_be_enabled()
    await page.screenshot(path=shots / "run-retried.png", full_page=True)

    await page.click("#rerun")

    await expect(page.locator("#rerun-of")).to_contain_text(run_id)
    assert run_id not in page.url
    await page.screenshot(path=shots / "run-rerun.png", full_page=True)
    await page.click("#rerun-of a")
    await expect(page.locator("h1 code")).to_have_text(run_id)
    assert not failures, failures
