"""``GET /``: the dashboard, a single page of static files shipped inside the package.

The page is plain HTML, CSS and JavaScript (no build step, nothing from a CDN: the machines
it runs on may have no internet). It signs in with the admin token or a tenant's API key, kept
in the browser tab's ``sessionStorage``, and reads the same JSON API and event streams as
every client, with ``Authorization: Bearer``; it has no route of its own beyond its files.
The policy below keeps the page to its own origin, so even a run's output that holds markup
cannot load or send anything elsewhere.
"""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "dashboard" / "static"
ASSETS_PATH = "/dashboard"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def dashboard() -> FileResponse:
    """The dashboard's page; its script and styles are under ``/dashboard/``."""
    return FileResponse(STATIC_DIR / "index.html", headers=SECURITY_HEADERS)


def install(app: FastAPI) -> None:
    """Serve the dashboard page at ``/`` and its static files under ``/dashboard/``."""
    app.add_api_route("/", dashboard, methods=["GET"], include_in_schema=False)
    app.mount(ASSETS_PATH, StaticFiles(directory=STATIC_DIR), name="dashboard")
