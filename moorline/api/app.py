"""The HTTP application: ``create_app`` builds a fresh FastAPI app per call.

Nothing here is module-level state: the CLI (or a test) builds ``Settings`` and a
``DatabaseManager`` and hands them in, so two apps in one process never share an engine.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from moorline.api.routes import health
from moorline.db.manager import DatabaseManager
from moorline.settings import Settings

API_VERSION = "1"


def create_app(settings: Settings, db: DatabaseManager) -> FastAPI:
    """Build the API application over an initialized database.

    Args:
        settings: the process settings, kept on ``app.state.settings``.
        db: a DatabaseManager whose schema was checked (``await db.initialize()``); kept on
            ``app.state.db`` and disposed when the application shuts down.

    Returns:
        A new FastAPI application; for now it serves ``/healthz`` and ``/readyz`` only.
    """

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # The app owns the pool from here on: a SIGTERM'd server closes its connections
            # instead of leaving them for the database to time out.
            await db.dispose()

    app = FastAPI(
        title="Moorline",
        summary="Durable, multi-tenant execution for LLM and agent workloads.",
        version=API_VERSION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.db = db
    app.include_router(health.build_router())
    return app
