"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served entirely by the API itself.

The scripts and styles come from the ``fastapi-offline`` package, installed with Moorline and
mounted at :data:`DOCS_ASSETS_URL` (FastAPI's default pages load them from a CDN: a blank page
offline or behind a strict proxy). The pages are FastAPI's own, pointed at those files, with a
``Content-Security-Policy`` that lets them load nothing from elsewhere: ReDoc's bundle still
names an image on its vendor's CDN (the "API docs by Redocly" logo), which the browser then
does not even request.
"""

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

DOCS_ASSETS_URL = "/docs-assets"
"""Where the Swagger UI and ReDoc files are served from."""

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'"
)
"""Only this server: FastAPI's pages start their viewer with an inline script, and ReDoc runs
its search in a worker built from a ``blob:`` URL."""


def install_docs(app: FastAPI) -> None:
    """Add ``/docs`` and ``/redoc`` to ``app`` (built by ``FastAPIOffline`` with both off)."""
    openapi_url = app.openapi_url or "/openapi.json"

    async def swagger_ui() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS_URL}/favicon.png",
        )
        page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return page

    async def redoc() -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{DOCS_ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
        page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return page

    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
