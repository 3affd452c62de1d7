"""The run page shows a run's tree in a real browser: its children, and a child's parent.

A real ``moorline serve --workers 1`` (SQLite, the bundled example app) runs ``doc_check`` on a
three-section document: each section is checked by a child run. Debian's chromium (as in
``test_dashboard.py``) signs in with the tenant's key, opens the parent and finds the
``#children`` table with a linked row per section; it follows a child's link, finds the
``#parent`` link back, and follows that. Screenshots go under the test's temporary folder,
whose path the test prints.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, async_playwright, expect

from tests.acceptance.test_dashboard import (
    ADMIN_TOKEN,
    CHROMIUM,
    STARTUP_S,
    UI_TIMEOUT_MS,
    Server,
    sign_in,
)
from tests.integration.test_cli import cli_env, free_port

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and os.environ.get("CI") != "true",
    reason="Debian's chromium is not installed (make test installs it)",
)

DOCUMENT = """# Install
Run `pip install moorline` to install it.

# Configure
Set `MOORLINE_DATABASE_URL` to your database.

# Run
Start it with `moorline serve`.
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """``moorline serve`` with the bundled example app (no MOORLINE_APP), on SQLite."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moorline", "serve", "--port", str(port), "--workers", "1"],
            cwd=tmp_path,
            env=cli_env(
                MOORLINE_DATABASE_URL=f"sqlite+aiosqlite:///{tmp_path / 'moorline.db'}",
                MOORLINE_ADMIN_TOKEN=ADMIN_TOKEN,
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


async def submit_doc_check(server: Server) -> tuple[str, str]:
    """A new tenant's key, and the id of the ``doc_check`` run it triggered."""
    async with httpx.AsyncClient(base_url=server.url) as client:
        created = await client.post(
            "/v1/admin/tenants",
            json={"name": f"docs-{uuid.uuid4().hex[:6]}", "plan": "team"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert created.status_code == 201, created.text
        key = str(created.json()["api_key"])
        submitted = await client.post(
            "/v1/workflows/doc_check/runs",
            json={"input": {"document": DOCUMENT, "title": "README"}},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert submitted.status_code == 202, submitted.text
    return key, str(submitted.json()["run_id"])


async def test_the_run_page_links_a_parent_and_its_children_both_ways(
    server: Server, browser: Browser, tmp_path: Path
) -> None:
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots: {shots}")
    key, parent_id = await submit_doc_check(server)
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(UI_TIMEOUT_MS)
    failures: list[str] = []
    page.on("pageerror", lambda error: failures.append(str(error)))
    await page.goto(server.url + "/")
    await sign_in(page, key)

    # The parent: a row per section, each linking to its child run, every one succeeded.
    await page.goto(f"{server.url}/#/runs/{parent_id}")
    await expect(page.locator("h1 .badge")).to_have_text("succeeded")
    rows = page.locator("#children tbody tr")
    await expect(rows).to_have_count(3)
    for index in range(3):
        row = rows.nth(index)
        await expect(row).to_contain_text(f"section:{index}")
        await expect(row).to_contain_text("doc_check_section")
        await expect(row.locator(".badge")).to_have_text("succeeded")
    await expect(page.locator("#parent")).to_have_count(0)
    await page.screenshot(path=shots / "parent.png", full_page=True)

    # Down to the first child, and back up through its #parent link.
    link = rows.nth(0).locator("a")
    href = await link.get_attribute("href")
    assert href is not None and href.startswith("#/runs/")
    child_id = href.removeprefix("#/runs/")
    await link.click()
    await expect(page).to_have_url(f"{server.url}/#/runs/{child_id}")
    await expect(page.locator("h1")).to_contain_text(child_id)
    await expect(page.locator("[data-fact=workflow]")).to_have_text("doc_check_section")
    await expect(page.locator("#parent")).to_contain_text(parent_id)
    await expect(page.locator("#children")).to_have_count(0)
    await page.screenshot(path=shots / "child.png", full_page=True)
    await page.locator("#parent a").click()
    await expect(page).to_have_url(f"{server.url}/#/runs/{parent_id}")
    await expect(page.locator("#children tbody tr")).to_have_count(3)
    assert not failures, failures
