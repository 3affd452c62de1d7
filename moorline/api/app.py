"""The HTTP application: ``create_app`` builds a fresh FastAPI app per call.

Nothing here is module-level state: the CLI (or a test) builds ``Settings`` and a
``DatabaseManager`` and hands them in, with the user's :class:`~moorline.engine.registry.Moorline`
app, whose registry the API reads to validate triggers (it never runs a workflow: that is the
worker's job). Everything else the routes need is built here, once, into
:class:`~moorline.api.deps.Services` on ``app.state.services``:

- admission (:class:`~moorline.admission.admit.Admission`) with its rate limiter, quota store
  and a :class:`~moorline.dispatch.submit.Submitter` whose group-committed batches wake their
  lanes' workers through the deployment's wake-ups (Redis, LISTEN/NOTIFY or in-process);
- the repositories the routes read, and the RuntimeStore that carries decisions to paused runs,
  cancels to running ones, messages to their workflows and their live events to streams.

Their connections open on first use, so an app also serves without its lifespan having run
(``httpx.ASGITransport`` does not run it); the lifespan's exit closes them all, in reverse
order of construction, and disposes the database.
"""

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from moorline.admission.stack import build_admission
from moorline.api.deps import Services, StreamSlots
from moorline.api.docs import DOCS_ASSETS_URL, install_docs
from moorline.api.errors import install_error_handlers
from moorline.api.guards import RequestGuard
from moorline.api.openapi import complete_openapi
from moorline.api.routes import (
    admin,
    admin_runs,
    admin_workers,
    batch,
    bulk,
    catalogue,
    dashboard,
    health,
    keys,
    metrics,
    run_actions,
    runs,
    schedules,
    stats,
    usage,
    webhook_admin,
    webhooks,
)
from moorline.db.manager import DatabaseManager
from moorline.db.repos.bulk_jobs import BulkJobsRepo
from moorline.db.repos.interrupts import InterruptsRepo
from moorline.db.repos.steps import StepsRepo
from moorline.db.repos.tenants import AUTH_CACHE_TTL_S, TenantsRepo
from moorline.db.repos.usage import UsageRepo
from moorline.db.repos.webhooks import WebhooksRepo
from moorline.engine.inbox import Inbox
from moorline.engine.loader import load_app
from moorline.engine.registry import Moorline
from moorline.engine.streams import EventStreams
from moorline.llm.models import ModelsProvider
from moorline.observability import tracing
from moorline.observability.metrics import Metrics
from moorline.plans import PlansProvider, resolve_plans
from moorline.runtime.factory import make_runtime_store
from moorline.settings import Settings

API_VERSION = "1"


def create_app(
    settings: Settings, db: DatabaseManager, *, workflows: Moorline | None = None
) -> FastAPI:
    """Build the API application over an initialized database.

    Args:
        settings: the process settings.
        db: a DatabaseManager whose schema was checked (``await db.initialize()``); kept on
            ``app.state.db`` and disposed when the application shuts down.
        workflows: the app whose workflows may be triggered; default the one ``--app`` /
            ``MOORLINE_APP`` names, else the bundled example app.

    Returns:
        A new FastAPI application serving every route of API v1 built so far.

    Raises:
        ConfigError: the plans file or the workflows app is invalid.
    """
    services, closing = _build_services(settings, db, workflows)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The app owns the pool and the clients from here on: a SIGTERM'd server lets the
        # decisions in flight finish, then closes its connections instead of leaving them
        # for the servers to time out.
        async with closing:
            yield

    # fastapi-offline mounts Swagger UI's and ReDoc's files at DOCS_ASSETS_URL; the pages
    # themselves are moorline.api.docs' (with a CSP). Other arguments go to FastAPI as they are.
    app: FastAPI = FastAPIOffline(
        docs_url=None,
        redoc_url=None,
        static_url=DOCS_ASSETS_URL,
        title="Moorline",
        summary="Durable, multi-tenant execution for LLM and agent workloads.",
        version=API_VERSION,
        lifespan=lifespan,
        # A JSON body without a Content-Type is still JSON; JSONBodyRoute refuses other types.
        strict_content_type=False,
        # FastAPI's OpenTelemetry hooks: its request spans when tracing is on, else none.
        telemetry=tracing.fastapi_telemetry(),
    )
    complete_openapi(app, resolve_plans(settings))
    app.state.settings = settings
    app.state.db = db
    app.state.services = services
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes)
    # The bulk routes ahead of every route with a run id: ``/v1/runs/bulk/cancel`` would match
    # ``/v1/runs/{run_id}/cancel`` too. Then the runs routes: a request is matched against the
    # routes in order, and triggers are the hot path (runs.install puts the trigger first).
    app.include_router(bulk.build_router())
    app.include_router(bulk.build_admin_router())
    runs.install(app)
    app.include_router(run_actions.build_router())
    app.include_router(run_actions.build_admin_router())
    modules = (
        batch,
        health,
        admin,
        admin_runs,
        admin_workers,
        keys,
        webhooks,
        webhook_admin,
        schedules,
        stats,
        usage,
        metrics,
        catalogue,
    )
    for module in modules:
        app.include_router(module.build_router())
    install_docs(app)
    dashboard.install(app)
    return app


def _build_services(
    settings: Settings, db: DatabaseManager, workflows: Moorline | None
) -> tuple[Services, AsyncExitStack]:
    """The services, and the exit stack that closes them (last built, first closed)."""
    # What can fail on a bad configuration comes first, before any client exists.
    registry = workflows if workflows is not None else load_app(settings.app)
    plans = PlansProvider(settings)
    models = ModelsProvider(settings)
    closing = AsyncExitStack()
    closing.push_async_callback(db.dispose)
    store = make_runtime_store(settings)
    closing.push_async_callback(store.close)
    counted = Metrics()
    stack = build_admission(settings, db, closing, metrics=counted)
    services = Services(
        settings=settings,
        db=db,
        workflows=registry,
        plans=plans,
        tenants=TenantsRepo(db, auth_ttl_s=AUTH_CACHE_TTL_S),
        runs=stack.runs,
        listing=stack.listing,
        steps=StepsRepo(db),
        interrupts=InterruptsRepo(db),
        webhooks=WebhooksRepo(db),
        admission=stack.admission,
        rate_limiter=stack.rate_limiter,
        store=store,
        notifier=stack.notifier,
        waiter=stack.waiter,
        inbox=Inbox(db, store, wake=stack.notifier.notify),
        streams=EventStreams(db, store),
        stream_slots=StreamSlots(settings.max_streams_per_tenant),
        metrics=counted,
        bulk_jobs=BulkJobsRepo(db),
        usage=UsageRepo(db),
        models=models,
    )
    return services, closing
