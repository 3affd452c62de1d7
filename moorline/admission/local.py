"""``app.submit`` in process: admission over the app's own connections, opened on first use.

A program that only enqueues (a FastAPI or Django app, a script) has no API server and no
worker in it: :class:`LocalSubmissions` opens the database (``MOORLINE_DATABASE_URL``, with
``initialize``'s schema check) and builds the same admission stack as the API
(:func:`~moorline.admission.stack.build_admission`) on the first submission, in the event loop
that made it. Each submission then takes the HTTP route's way in
(:func:`~moorline.admission.submission.admit_submission`), so it is refused, counted and
stored as a trigger is.

The tenant stands in for the API key: its plan is read with the tenant, and both are trusted
for :data:`~moorline.db.repos.tenants.AUTH_CACHE_TTL_S` seconds (as an API process trusts a
key), so a plan change made elsewhere applies here within that bound and a submission costs
no read of the tenant. Its rate-limit window is ``app:<tenant id>``, apart from its keys'.
"""

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass

from moorline.admission.stack import AdmissionStack, build_admission
from moorline.admission.submission import (
    Origin,
    admit_each,
    admit_submission,
    check_submission,
    submitted,
)
from moorline.admission.triggers import as_refusal
from moorline.concurrency import TTLCache
from moorline.db.manager import DatabaseManager
from moorline.db.repos.tenants import AUTH_CACHE_TTL_S, TenantsRepo
from moorline.engine.registry import Moorline
from moorline.engine.submitting import Submission, Submissions, Submitted
from moorline.errors import MoorlineError, TenantNotFound
from moorline.observability.metrics import Metrics
from moorline.plans import PlansProvider
from moorline.types import TenantId


@dataclass(frozen=True, slots=True, kw_only=True)
class _Open:
    """What the first submission opened."""

    stack: AdmissionStack
    origins: TTLCache[str, Origin]


class LocalSubmissions(Submissions):
    """Submissions of one app in one event loop (see the module docstring)."""

    def __init__(self, workflows: Moorline) -> None:
        self._workflows = workflows
        self._closing = AsyncExitStack()
        self._open: _Open | None = None
        self._opening = asyncio.Lock()
        self._closed = False

    async def submit(self, submission: Submission, *, tenant: str) -> Submitted:
        # Refusals that need no database come first, as the route's 404 comes before admission.
        self._workflows.get(submission.workflow)
        check_submission(submission)
        opened = await self._opened()
        origin = await opened.origins.get(tenant)
        try:
            admitted = await admit_submission(
                opened.stack.admission, self._workflows, origin, submission
            )
        except Exception as exc:
            # A driver's error of an outage is raised as the HTTP route answers it (503).
            refusal = as_refusal(exc)
            if refusal is None or refusal is exc:
                raise
            raise refusal from exc
        return submitted(admitted)

    async def submit_many(
        self, submissions: list[Submission], *, tenant: str
    ) -> list[Submitted | MoorlineError]:
        if not submissions:
            return []
        opened = await self._opened()
        origin = await opened.origins.get(tenant)
        outcomes = await admit_each(opened.stack.admission, self._workflows, origin, submissions)
        return [o if isinstance(o, MoorlineError) else submitted(o) for o in outcomes]

    async def close(self) -> None:
        self._closed = True
        await self._closing.aclose()

    async def _opened(self) -> _Open:
        if self._open is not None:
            return self._open
        async with self._opening:
            if self._open is None:
                self._open = await self._open_all()
            return self._open

    async def _open_all(self) -> _Open:
        if self._closed:
            raise RuntimeError("this app's submissions are closed")
        settings = self._workflows.settings
        plans = PlansProvider(settings)  # a broken plans file fails here, before connecting
        opening = AsyncExitStack()
        try:
            db = DatabaseManager(settings)
            opening.push_async_callback(db.dispose)
            await db.initialize()
            stack = build_admission(settings, db, opening, metrics=Metrics())
        except BaseException:
            # A database that does not answer leaves nothing open: the next submit starts over.
            await opening.aclose()
            raise
        self._closing.push_async_callback(opening.aclose)
        tenants = TenantsRepo(db)

        async def origin_of(tenant: str) -> Origin:
            found = await tenants.get(TenantId(tenant))
            if found is None:
                # Raised, so not kept: a tenant created a moment later is found at once.
                raise TenantNotFound(f"no tenant {tenant}")
            return Origin(
                tenant_id=found.tenant_id,
                plan=await plans.get(found.plan),
                rate_identity=f"app:{found.tenant_id}",
            )

        origins: TTLCache[str, Origin] = TTLCache(
            origin_of, ttl_s=AUTH_CACHE_TTL_S, name="submitting tenants"
        )
        return _Open(stack=stack, origins=origins)
