"""Issue 21's dashboard pages in a real browser: statistics, search, time range, narrow screens.

Same server and browser fixtures as ``test_dashboard.py`` (Debian's chromium), every request
outside the server blocked and asserted never tried (``offline_page``). A tenant with a known
name runs three ``publish_notes`` (approved over HTTP) and two ``fail_loudly``; its Statistics
page must show those counts, its search find a run by id and by a word of its input, a run's
timeline its approval wait, its times be UTC; the admin sees the tenant's name; a tenant's
admin page says it is not for it; at 420 px the runs and statistics tables fit the width.
Screenshots, and ``notes.txt`` saying what each shows, go to the printed folder.
"""

import uuid
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, expect

from tests.acceptance.test_dashboard import (
    ADMIN_TOKEN,
    CHROMIUM,
    Server,
    browser,
    server,
    sign_in,
)
from tests.acceptance.test_dx_pages import offline_page
from tests.helpers import wait_for

__all__ = ["browser", "server"]  # fixtures, imported for pytest

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and __import__("os").environ.get("CI") != "true",
    reason="Debian's chromium is not installed (make test installs it)",
)

TOPICS = ("lighthouse-keeper", "harbour", "quay")


async def finished_runs(server: Server, tenant_name: str) -> tuple[str, dict[str, str]]:
    """The tenant's API key, and its runs by topic (``fail-1``, ``fail-2`` for the failures)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        created = await client.post(
            "/v1/admin/tenants", json={"name": tenant_name, "plan": "team"}, headers=admin
        )
        assert created.status_code == 201, created.text
        key = created.json()["api_key"]
        tenant = {"Authorization": f"Bearer {key}"}
        runs: dict[str, str] = {}
        for topic in TOPICS:
            answer = await client.post(
                "/v1/workflows/publish_notes/runs", json={"input": {"topic": topic}}, headers=tenant
            )
            runs[topic] = answer.json()["run_id"]
        for n in (1, 2):
            answer = await client.post(
                "/v1/workflows/fail_loudly/runs", json={"input": {}}, headers=tenant
            )
            runs[f"fail-{n}"] = answer.json()["run_id"]

        async def reached(run_id: str, statuses: set[str]) -> bool:
            run = (await client.get(f"/v1/runs/{run_id}", headers=tenant)).json()
            return run["status"] in statuses

        for topic in TOPICS:
            asking = runs[topic]
            assert await wait_for(
                lambda: reached(asking, {"waiting"}),  # noqa: B023 - awaited in the iteration
                timeout_s=30,
                message=f"{topic} to ask",
            )
            approved = await client.post(
                f"/v1/runs/{asking}/resume", json={"approved": True}, headers=tenant
            )
            assert approved.status_code == 200, approved.text
        ended = {"succeeded", "failed"}
        for run_id in list(runs.values()):
            assert await wait_for(
                lambda: reached(run_id, ended),  # noqa: B023 - awaited in the iteration
                timeout_s=30,
                message="the runs to end",
            )
    return key, runs


async def fits(page: Page, selector: str) -> None:
    """``selector``'s right edge, and the page's width, are within the viewport."""
    width = await page.evaluate("window.innerWidth")
    right = await page.evaluate(
        f"document.querySelector({selector!r}).getBoundingClientRect().right"
    )
    scroll = await page.evaluate("document.documentElement.scrollWidth")
    assert right <= width and scroll <= width, (selector, right, scroll, width)


async def test_statistics_search_and_narrow_screens(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    notes: list[str] = []
    print(f"dashboard screenshots: {shots}")
    name = f"acme-{uuid.uuid4().hex[:6]}"
    key, runs = await finished_runs(server, name)

    page, tried = await offline_page(browser, server)
    failures: list[str] = []
    page.on("pageerror", lambda error: failures.append(str(error)))
    await page.set_viewport_size({"width": 1280, "height": 900})
    await page.goto(server.url + "/")
    await sign_in(page, key)
    await expect(page.locator("#who")).to_contain_text(f"tenant {name} (team)")

    # Statistics: the known counts, per workflow.
    await page.click("#nav a[data-page=stats]")
    publish = page.locator("#stats-body tr[data-workflow=publish_notes]")
    failing = page.locator("#stats-body tr[data-workflow=fail_loudly]")
    await expect(publish.locator("[data-stat=ended]")).to_have_text("3")
    await expect(publish.locator("[data-stat=failure]")).to_have_text("0.0 %")
    await expect(failing.locator("[data-stat=ended]")).to_have_text("2")
    await expect(failing.locator("[data-stat=failure]")).to_have_text("100.0 %")
    await expect(page.locator("#stats-rate-chart")).to_contain_text("runs / min")
    await expect(page.locator("#stats-note")).to_contain_text("UTC")
    await page.screenshot(path=str(shots / "stats.png"), full_page=True)
    notes.append(
        "stats.png: a tenant's Statistics, last hour: publish_notes 3 ended, 0.0 % failed; "
        "fail_loudly 2 ended, 100.0 %; runs per minute as bars with axes."
    )

    # Search by the short id the table shows (a run id's last 8 characters), then by a word of
    # an input.
    await page.click("#nav a[data-page=runs]")
    await expect(page.locator("#runs-body tr[data-run-id]")).to_have_count(5)
    wanted = runs["harbour"]
    await expect(page.locator(f"#runs-body tr[data-run-id='{wanted}'] code")).to_have_text(
        wanted[-8:]
    )
    await page.fill("#search", wanted[-8:])
    await page.press("#search", "Enter")
    await expect(page.locator("#runs-body tr[data-run-id]")).to_have_count(1)
    await expect(page.locator(f"#runs-body tr[data-run-id='{wanted}']")).to_be_visible()
    await page.fill("#search", "Lighthouse")
    await page.press("#search", "Enter")
    await expect(page.locator("#runs-body tr[data-run-id]")).to_have_count(1)
    lighthouse = runs["lighthouse-keeper"]
    await expect(page.locator(f"#runs-body tr[data-run-id='{lighthouse}']")).to_be_visible()
    await page.screenshot(path=str(shots / "search.png"), full_page=True)
    notes.append("search.png: the runs table searched for 'Lighthouse': the one run with it.")
    # A time range: the last 15 minutes hold all five.
    await page.fill("#search", "")
    await page.select_option("#filter-range", "900")
    await expect(page).to_have_url(f"{server.url}/#/runs?range=900")
    await expect(page.locator("#runs-body tr[data-run-id]")).to_have_count(5)

    # A run's timeline draws its approval wait; its times are UTC.
    await page.goto(f"{server.url}/#/runs/{lighthouse}")
    await expect(page.locator("#steps .wait-row")).to_contain_text("approval: publish")
    await expect(page.locator("#steps .wait-row")).to_contain_text("(approved)")
    await expect(page.locator("#steps .axis")).to_contain_text("0 s")
    await expect(page.locator("dd[data-fact=created]")).to_contain_text(" UTC")
    await page.screenshot(path=str(shots / "timeline.png"), full_page=True)
    notes.append(
        "timeline.png: a publish_notes run: steps draft and publish, between them the approval "
        "wait (violet), a seconds axis; times in UTC."
    )

    # A tenant opening an admin page is told so.
    await page.goto(f"{server.url}/#/lanes")
    await expect(page.locator("#forbidden")).to_contain_text("is for the admin")

    # 420 px: the runs and statistics tables fit the width (no cut-off at the right).
    await page.set_viewport_size({"width": 420, "height": 800})
    await page.goto(f"{server.url}/#/runs")
    await expect(page.locator("#runs-body tr[data-run-id]")).to_have_count(5)
    await fits(page, "#runs")
    await page.screenshot(path=str(shots / "runs-420.png"), full_page=True)
    notes.append(
        "runs-420.png: the runs table at 420 px: lane and attempt left out, the rest within "
        "the width; the header wraps."
    )
    await page.goto(f"{server.url}/#/stats")
    await expect(page.locator("#stats-body tr[data-workflow]")).to_have_count(2)
    await fits(page, "#stats")
    await page.screenshot(path=str(shots / "stats-420.png"), full_page=True)
    notes.append("stats-420.png: Statistics at 420 px, the by-status column left out.")

    # The admin sees the tenant's name in the runs table, not its id.
    admin, admin_tried = await offline_page(browser, server)
    await admin.set_viewport_size({"width": 1280, "height": 900})
    await admin.goto(server.url + "/")
    await sign_in(admin, ADMIN_TOKEN)
    await admin.goto(f"{server.url}/#/runs?q={lighthouse[-8:]}")
    row = admin.locator(f"#runs-body tr[data-run-id='{lighthouse}']")
    await expect(row).to_contain_text(name)
    await expect(admin.locator("#runs-note")).to_contain_text("1 run on this page")
    await admin.screenshot(path=str(shots / "admin-runs.png"), full_page=True)
    notes.append(
        f"admin-runs.png: the admin's runs table found by id, the tenant column showing its "
        f"name ({name})."
    )

    (shots / "notes.txt").write_text("\n".join(notes) + "\n", encoding="utf-8")
    assert tried == [] and admin_tried == []
    assert failures == []
