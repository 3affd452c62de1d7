"""Bulk retry and cancel from the Runs page in a real browser (``moorline serve --workers 1``).

The admin ticks two of three failed runs and retries them as one job, whose progress the page
follows to the end; then retries every run the filters match; then cancels a run that waits
for a decision, ticked. Each retried run is retried once (one more attempt), the unticked one
not before the "all matching" job. Screenshots go under the test's temporary folder, whose
path the test prints.
"""

import uuid
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from playwright.async_api import Browser, Dialog, expect

from tests.acceptance import test_dashboard as dashboard
from tests.acceptance.test_dashboard import ADMIN_TOKEN, UI_TIMEOUT_MS, Server, sign_in
from tests.helpers import wait_for

server = dashboard.server
browser = dashboard.browser
pytestmark = dashboard.pytestmark


async def attempts_of(client: httpx.AsyncClient, key: str, run_id: str) -> tuple[str, int]:
    """The run's status and attempts (one attempt each: a retried run failed again has two)."""
    run = (await client.get(f"/v1/runs/{run_id}", headers=bearer(key))).json()
    return run["status"], run["attempt"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_bulk_retry_and_cancel_from_the_runs_page(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        created = await client.post(
            "/v1/admin/tenants",
            json={"name": f"t-{uuid.uuid4().hex[:6]}", "plan": "team"},
            headers=bearer(ADMIN_TOKEN),
        )
        key = created.json()["api_key"]
        tenant_id = created.json()["tenant_id"]
        failed = []
        for _ in range(3):
            started = await client.post(
                "/v1/workflows/fail_loudly/runs", json={}, headers=bearer(key)
            )
            failed.append(started.json()["run_id"])

        async def all_failed() -> bool:
            runs = await client.get("/v1/runs", params={"status": "failed"}, headers=bearer(key))
            return len(runs.json()["runs"]) == 3

        await wait_for(all_failed, timeout_s=30, message="three failed runs")
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(UI_TIMEOUT_MS)
        failures: list[str] = []
        page.on("pageerror", lambda error: failures.append(str(error)))
        dialogs: list[str] = []

        async def accept(dialog: Dialog) -> Any:
            dialogs.append(dialog.message)
            await dialog.accept()

        page.on("dialog", accept)
        await page.goto(server.url + "/")
        await sign_in(page, ADMIN_TOKEN)
        await page.goto(f"{server.url}/#/runs?status=failed&tenant_id={tenant_id}")
        await expect(page.locator("#runs-body tr")).to_have_count(3)
        await expect(page.locator("#bulk-retry")).to_be_disabled()
        # Nothing selected: "Cancel selected" is disabled, and drawn plain, not in pale red.
        cancel_selected = page.locator("#bulk-cancel")
        await expect(cancel_selected).to_be_disabled()
        await expect(cancel_selected).to_have_css("background-color", "rgb(255, 255, 255)")

        for run_id in failed[:2]:
            await page.check(f"input.select-run[data-run-id='{run_id}']")
        await expect(page.locator("#bulk-count")).to_have_text("2 selected")
        await page.screenshot(path=shots / "runs-two-selected.png", full_page=True)
        await page.click("#bulk-retry")

        await expect(page.locator("#bulk-progress")).to_have_attribute("data-state", "finished")
        await expect(page.locator("#bulk-progress")).to_contain_text("2 retried")
        await expect(page.locator("#bulk-count")).to_have_text("none selected")
        await page.screenshot(path=shots / "runs-bulk-retried.png", full_page=True)
        assert dialogs == ["Retry 2 selected runs?"]

        async def failed_after(run_id: str, attempts: int) -> bool:
            return await attempts_of(client, key, run_id) == ("failed", attempts)

        for run_id in failed[:2]:
            await wait_for(partial(failed_after, run_id, 2), message=f"{run_id} retried")
        assert await attempts_of(client, key, failed[2]) == ("failed", 1)

        # Then every failed run of the tenant: the filters of the page.
        await page.click("#bulk-retry-matching")
        await expect(page.locator("#bulk-progress")).to_contain_text("3 retried")
        for run_id, attempts in zip(failed, (3, 3, 2), strict=True):
            await wait_for(partial(failed_after, run_id, attempts), message=f"{run_id} retried")

        # A run waiting for its permission, ticked and cancelled.
        waiting = await client.post(
            "/v1/workflows/publish_notes/runs", json={}, headers=bearer(key)
        )
        waiting_id = waiting.json()["run_id"]

        async def waits() -> bool:
            return (await attempts_of(client, key, waiting_id))[0] == "waiting"

        await wait_for(waits, timeout_s=30, message="the run waiting for its permission")
        await page.goto(f"{server.url}/#/runs?status=waiting&tenant_id={tenant_id}")
        await page.check(f"input.select-run[data-run-id='{waiting_id}']")
        await page.click("#bulk-cancel")
        await expect(page.locator("#bulk-progress")).to_contain_text("1 cancelled")
        assert (await attempts_of(client, key, waiting_id))[0] == "cancelled"
        assert dialogs[-1] == "Cancel 1 selected runs?"

        # A lane filter cannot be sent with a bulk action: "all matching" is off with one.
        await page.goto(f"{server.url}/#/runs?lane=workflow_team")
        await expect(page.locator("#bulk-retry-matching")).to_be_disabled()
        assert not failures, failures
