"""Issue 21 in a real browser: ``/docs`` and ``/redoc`` render with every request outside the
server blocked, and the dashboard shows a failed run's traceback.

Same server and browser fixtures as ``test_dashboard.py`` (Debian's chromium).
"""

import uuid
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.async_api import Browser, Page, Route, expect

from tests.acceptance.test_dashboard import (
    ADMIN_TOKEN,
    UI_TIMEOUT_MS,
    Server,
    browser,
    server,
    sign_in,
)
from tests.helpers import wait_for

__all__ = ["browser", "server"]  # fixtures, imported for pytest

pytestmark = pytest.mark.skipif(
    not __import__("pathlib").Path("/usr/bin/chromium").exists()
    and __import__("os").environ.get("CI") != "true",
    reason="Debian's chromium is not installed (make test installs it)",
)


async def offline_page(browser: Browser, server: Server) -> tuple[Page, list[str]]:
    """A page whose requests to anywhere but the server fail, and the list of those tried."""
    tried: list[str] = []
    own = urlsplit(server.url).netloc
    page = await browser.new_page()

    async def only_the_server(route: Route) -> None:
        if urlsplit(route.request.url).netloc == own:
            await route.continue_()
        else:
            tried.append(route.request.url)
            await route.abort()

    await page.route("**/*", only_the_server)
    page.set_default_timeout(UI_TIMEOUT_MS)
    return page, tried


async def test_docs_and_redoc_render_offline(browser: Browser, server: Server) -> None:
    page, tried = await offline_page(browser, server)
    await page.goto(server.url + "/docs")
    # Swagger UI rendered the document: an operation of API v1 is on the page.
    await expect(page.locator(".swagger-ui .opblock").first).to_be_visible()
    await expect(page.locator(".swagger-ui")).to_contain_text("/v1/workflows")
    await page.goto(server.url + "/redoc")
    await expect(page.locator("redoc, [class*=redoc], body").first).to_contain_text(
        "/v1/workflows/{workflow}/runs"
    )
    assert tried == []


async def test_the_dashboard_shows_a_failed_runs_traceback(
    browser: Browser, server: Server
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        created = await client.post(
            "/v1/admin/tenants", json={"name": f"tb-{uuid.uuid4().hex[:8]}", "plan": "team"},
            headers=admin,
        )  # fmt: skip
        key = created.json()["api_key"]
        tenant = {"Authorization": f"Bearer {key}"}
        run_id = (
            await client.post("/v1/workflows/fail_loudly/runs", json={"input": {}}, headers=tenant)
        ).json()["run_id"]

        async def failed() -> bool:
            run = (await client.get(f"/v1/runs/{run_id}", headers=tenant)).json()
            return bool(run["status"] == "failed")

        assert await wait_for(failed, timeout_s=30, message="the run to fail")
    page, tried = await offline_page(browser, server)
    await page.goto(server.url + "/")
    await sign_in(page, ADMIN_TOKEN)
    await page.goto(f"{server.url}/#/runs/{run_id}")
    trace = page.locator("#result pre.traceback")
    await expect(trace).to_contain_text("Traceback (most recent call last):")
    await expect(trace).to_contain_text("RuntimeError: the model answered nonsense")
    await expect(page.locator("#result")).to_contain_text('"reason"')
    assert tried == []
