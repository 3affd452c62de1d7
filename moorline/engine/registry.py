"""The user's application object and its registry of workflows.

``Moorline`` is what users import and decorate with (``@app.workflow(...)``), like a FastAPI
app and its routes. The registry lives on that instance, never in a module-level dict, so two
apps in one process (tests) never see each other's workflows.
"""

import asyncio
import functools
import inspect
import math
import re
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from moorline.engine.submitting import Submission, Submissions, Submitted, SyncPortal
from moorline.errors import ConfigError, InvalidInput, MoorlineError, WorkflowNotFound
from moorline.settings import Settings, load_settings
from moorline.types import JSONObject

WorkflowFn = Callable[..., Coroutine[Any, Any, Any]]
F = TypeVar("F", bound=WorkflowFn)
T = TypeVar("T")

DEFAULT_MAX_ATTEMPTS = 3
# Workflow names are persisted and appear in URLs: keep them to a safe, stable alphabet.
NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,199}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowDefinition:
    """One registered workflow: its persisted name, function, limits and input model.

    Attributes:
        timeout_s: Hard time limit of an attempt in seconds; None for
            ``MOORLINE_EXECUTION_TIMEOUT``.
        soft_timeout_s: Seconds after which ``SoftTimeLimitExceeded`` is raised inside an
            attempt; None for no soft limit.
        deadline_s: Wall-clock limit of a whole run from its creation, waits included: a
            run still waiting past it ends ``timed_out``. None for no deadline.
    """

    name: str
    fn: WorkflowFn
    max_attempts: int
    timeout_s: float | None
    input_model: type[BaseModel]
    parameters: tuple[str, ...] = field(default=())
    soft_timeout_s: float | None = None
    deadline_s: float | None = None
    max_children: int = 1_000

    def validate_input(self, data: Mapping[str, Any]) -> JSONObject:
        """Check ``data`` against the function's parameters; return it as JSON-ready values.

        Raises:
            InvalidInput: naming the first offending field.
        """
        try:
            model = self.input_model.model_validate(dict(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "input"
            raise InvalidInput(
                f"input of workflow {self.name!r}: {where}: {first['msg']}"
            ) from None
        dumped: JSONObject = model.model_dump(mode="json")
        return dumped

    def parameters_schema(self) -> JSONObject:
        """The JSON Schema of the workflow's input, as the function's signature declares it.

        The same model :meth:`validate_input` checks with, so the catalogue (``GET
        /v1/workflows``) can never describe an input the trigger would refuse.
        """
        schema: JSONObject = self.input_model.model_json_schema()
        schema["title"] = self.name  # not the generated model's ``<name>_input``
        return schema

    def bind(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """Validated keyword arguments (pydantic-converted values) for calling ``fn``."""
        model = self.input_model.model_validate(dict(data))
        return {name: getattr(model, name) for name in self.parameters}


def _input_model(name: str, fn: WorkflowFn) -> tuple[type[BaseModel], tuple[str, ...]]:
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    if not params:
        raise ConfigError(f"workflow {name!r}: its first parameter must be the Context")
    fields: dict[str, Any] = {}
    for param in params[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"workflow {name!r}: *args/**kwargs cannot be validated")
        annotation = Any if param.annotation is inspect.Parameter.empty else param.annotation
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (annotation, default)
    model = create_model(
        f"{name}_input",
        __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=False),
        **fields,
    )
    return model, tuple(fields)


class Moorline:
    """A Moorline application: the workflows it can run and the settings it runs them with.

    Example:
        app = Moorline()

        @app.workflow("review_pr", max_attempts=3, timeout=600)
        async def review_pr(ctx: Context, pr_number: int, diff: str) -> dict: ...
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._workflows: dict[str, WorkflowDefinition] = {}
        # Built on the first submit, for the event loop it ran in (see _submissions_here).
        self._submissions: Submissions | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._portal: SyncPortal | None = None
        self._portal_lock = threading.Lock()  # sync callers may come from many threads

    @property
    def settings(self) -> Settings:
        """The app's settings; read from ``MOORLINE_*`` variables on first use."""
        if self._settings is None:
            self._settings = load_settings()
        return self._settings

    def workflow(
        self,
        name: str,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        timeout: float | None = None,
        soft_timeout: float | None = None,
        deadline: float | None = None,
        max_children: int = 1_000,
    ) -> Callable[[F], F]:
        """Register an ``async def`` workflow under a persisted ``name``.

        Both time limits apply to each attempt, counted on the worker's monotonic clock.

        Args:
            name: The workflow's persisted name (letters, digits, ``_``, ``.``, ``-``).
            max_attempts: Claims a run may have before it ends ``failed``.
            timeout: Hard limit in seconds: past it the workflow is cancelled and the run
                ends ``timed_out``, without a retry. None for ``MOORLINE_EXECUTION_TIMEOUT``.
            soft_timeout: Seconds after which ``moorline.SoftTimeLimitExceeded`` is raised
                inside the workflow, at its current ``await``, so it can clean up: returning
                then succeeds the run, letting it escape fails the run without a retry. None
                for no soft limit; it must be below ``timeout`` when both are given.
            deadline: Wall-clock seconds from the run's creation, waits included, past which
                a run that is ``waiting`` ends ``timed_out`` (``timeout`` counts execution
                only). None for no deadline.
            max_children: Child runs one run may start (``ctx.start_child``); past it the
                workflow gets ``ChildLimitExceeded``.

        Raises:
            ConfigError: A bad name or limit, or a second workflow with this name.
        """
        if not NAME_PATTERN.match(name):
            raise ConfigError(f"workflow name {name!r}: use letters, digits, '_', '.', '-'")
        if max_attempts < 1:
            raise ConfigError(f"workflow {name!r}: max_attempts must be at least 1")
        if max_children < 0:
            raise ConfigError(f"workflow {name!r}: max_children must not be negative")
        for label, limit in (
            ("timeout", timeout),
            ("soft_timeout", soft_timeout),
            ("deadline", deadline),
        ):
            if limit is not None and not (0 < limit < math.inf):
                raise ConfigError(f"workflow {name!r}: {label} must be a positive number")
        if timeout is not None and soft_timeout is not None and soft_timeout >= timeout:
            raise ConfigError(f"workflow {name!r}: soft_timeout must be below timeout")

        def register(fn: F) -> F:
            registered = fn  # iscoroutinefunction's TypeGuard would narrow away the TypeVar
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(f"workflow {name!r}: must be an async def function")
            if name in self._workflows:
                raise ConfigError(f"workflow {name!r} is registered twice")
            model, parameters = _input_model(name, fn)
            self._workflows[name] = WorkflowDefinition(
                name=name,
                fn=fn,
                max_attempts=max_attempts,
                timeout_s=timeout,
                input_model=model,
                parameters=parameters,
                soft_timeout_s=soft_timeout,
                deadline_s=deadline,
                max_children=max_children,
            )
            # ``review_pr.submit(input, tenant=...)``: the app's submit, this workflow named.
            registered.submit = functools.partial(self.submit, name)  # type: ignore[attr-defined]
            return registered

        return register

    def get(self, name: str) -> WorkflowDefinition:
        """The workflow registered as ``name``, or ``WorkflowNotFound``."""
        try:
            return self._workflows[name]
        except KeyError:
            raise WorkflowNotFound(f"no workflow named {name!r}") from None

    def __iter__(self) -> Iterator[WorkflowDefinition]:
        return iter(self._workflows.values())

    def __contains__(self, name: object) -> bool:
        return name in self._workflows

    # --- submitting from Python, in process ---------------------------------------------------

    async def submit(
        self,
        workflow: str,
        input: Mapping[str, Any] | None = None,
        *,
        tenant: str,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay: float = 0.0,
    ) -> Submitted:
        """Start a run of ``workflow`` for ``tenant``, as ``POST /v1/workflows/{workflow}/runs``.

        The same admission as the HTTP route (rate limit, input, idempotency key,
        conversation, daily quota) and the same group commit; the run is durable when this
        returns. Needs only the database (and Redis, if configured): the connections open on
        the first call, in the running event loop, and :meth:`close` (or ``async with app``)
        closes them. The plan's rate limit counts the tenant's in-process submissions under
        an identity of their own (``app:<tenant id>``), apart from any API key's.

        Args:
            workflow: The registered workflow's name.
            input: Its arguments by parameter name.
            tenant: The tenant's id (``moorline tenants create`` prints it).
            idempotency_key: The same key and input again returns the first run.
            conversation_id: At most one active run per conversation.
            delay: Seconds before the run may be claimed.

        Returns:
            The run; ``created`` is False for a repeated idempotency key.

        Raises:
            MoorlineError: the HTTP route's refusal, as the class of its code:
                ``WorkflowNotFound``, ``InvalidInput``, ``InvalidRequest`` (a bad key,
                conversation id or delay), ``IdempotencyConflict``, ``ConversationBusy``,
                ``QuotaExceeded`` (the run is stored ``rate_limited``), ``RateLimited``,
                ``TenantNotFound``, ``BackendUnavailable``.
        """
        submission = Submission(
            workflow=workflow,
            input={} if input is None else input,
            idempotency_key=idempotency_key,
            conversation_id=conversation_id,
            delay=delay,
        )
        return await self._submissions_here().submit(submission, tenant=tenant)

    async def submit_many(
        self, submissions: Iterable[Submission], *, tenant: str
    ) -> list[Submitted | MoorlineError]:
        """Start many runs for ``tenant``: each admitted on its own, as the HTTP batch's items.

        They go through admission together, so the Submitter stores them in few
        transactions. Not all-or-nothing: each item's answer is its run or its refusal (the
        exception :meth:`submit` would raise), in the order given.
        """
        return await self._submissions_here().submit_many(list(submissions), tenant=tenant)

    async def close(self) -> None:
        """Finish submissions in flight and close the connections :meth:`submit` opened."""
        submissions, self._submissions, self._loop = self._submissions, None, None
        if submissions is not None:
            await submissions.close()

    async def __aenter__(self) -> "Moorline":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def submit_sync(
        self,
        workflow: str,
        input: Mapping[str, Any] | None = None,
        *,
        tenant: str,
        idempotency_key: str | None = None,
        conversation_id: str | None = None,
        delay: float = 0.0,
    ) -> Submitted:
        """:meth:`submit` for sync code: run on the app's own event loop thread.

        Blocks the calling thread until the run is stored; call :meth:`close_sync` when done.
        """
        return self._through_portal(
            self.submit(
                workflow,
                input,
                tenant=tenant,
                idempotency_key=idempotency_key,
                conversation_id=conversation_id,
                delay=delay,
            )
        )

    def submit_many_sync(
        self, submissions: Iterable[Submission], *, tenant: str
    ) -> list[Submitted | MoorlineError]:
        """:meth:`submit_many` for sync code (see :meth:`submit_sync`)."""
        return self._through_portal(self.submit_many(list(submissions), tenant=tenant))

    def close_sync(self) -> None:
        """Close what :meth:`submit_sync` opened, and stop its thread."""
        with self._portal_lock:
            portal, self._portal = self._portal, None
        if portal is not None:
            try:
                portal.run(self.close())
            finally:
                portal.close()

    def _through_portal(self, coroutine: Coroutine[Any, Any, T]) -> T:
        with self._portal_lock:
            if self._portal is None:
                self._portal = SyncPortal("moorline-submit")
            portal = self._portal
        return portal.run(coroutine)

    def _submissions_here(self) -> Submissions:
        """The submissions of the running event loop, built on first use.

        Connections, locks and the Submitter's writer belong to the loop that made them. A
        loop that has ended (``asyncio.run`` called again) left nothing usable, so the app
        starts afresh; another loop still running is a mistake, refused.
        """
        loop = asyncio.get_running_loop()
        if self._submissions is not None and self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError(
                    "this app submits from another running event loop; await app.close() there "
                    "first, or use one loop (submit_sync has a loop of its own)"
                )
            self._submissions = None
        if self._submissions is None:
            # Admission sits above the engine (it validates against this registry), so the
            # app reaches it here, on first use: the one import pyproject's layers contract
            # lets through (ignore_imports), and no module-level wiring.
            from moorline.admission.local import LocalSubmissions

            self._submissions = LocalSubmissions(self)
            self._loop = loop
        return self._submissions
