"""The dashboard's Schedules page in a real browser against a real ``moorline serve``.

A tenant signs in with its key and finds its schedule listed with its cadence and next tick;
it pauses, resumes and deletes it with the row's buttons, and the row follows each change.
The admin's navigation has no Schedules page (schedules are a tenant's). Screenshots go under
the test's temporary folder, whose path the test prints.
"""

import uuid
from pathlib import Path

import httpx
from playwright.async_api import Browser, expect

from tests.acceptance.test_dashboard import (
    ADMIN_TOKEN,
    UI_TIMEOUT_MS,
    Server,
    browser,
    pytestmark,
    server,
    sign_in,
)

__all__ = ["browser", "pytestmark", "server"]


async def test_a_tenant_pauses_resumes_and_deletes_its_schedule(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    async with httpx.AsyncClient(base_url=server.url) as client:
        tenant = await client.post(
            "/v1/admin/tenants",
            json={"name": f"sched-{uuid.uuid4().hex[:6]}", "plan": "team"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        key = tenant.json()["api_key"]
        created = await client.post(
            "/v1/schedules",
            json={"workflow": "publish_notes", "input": {"topic": "nightly"}, "cron": "0 3 * * *",
                  "timezone": "Europe/Berlin"},
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        assert created.status_code == 201, created.text
        schedule_id = created.json()["schedule_id"]
    page = await browser.new_page(viewport={"width": 1280, "height": 700})
    page.set_default_timeout(UI_TIMEOUT_MS)
    failures: list[str] = []
    page.on("pageerror", lambda error: failures.append(str(error)))
    await page.goto(server.url + "/")
    await sign_in(page, key)
    await page.click("#nav a[data-page=schedules]")
    row = page.locator(f"#schedules-body tr[data-schedule-id='{schedule_id}']")
    await expect(row).to_contain_text("0 3 * * * (Europe/Berlin)")
    await expect(row.locator(".state")).not_to_have_text("paused")
    await page.screenshot(path=shots / "schedules.png", full_page=True)
    await row.get_by_role("button", name="Pause").click()
    await expect(row.locator(".state")).to_have_text("paused")
    await page.screenshot(path=shots / "schedules-paused.png", full_page=True)
    await row.get_by_role("button", name="Resume").click()
    await expect(row.locator(".state")).not_to_have_text("paused")
    await row.get_by_role("button", name="Delete").click()
    await expect(row).to_have_count(0)
    await page.click("#sign-out")
    await sign_in(page, ADMIN_TOKEN)
    await expect(page.locator("#nav a[data-page=schedules]")).to_be_hidden()
    assert not failures, failures
