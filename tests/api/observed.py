"""Workflows of the operator-surface tests, run by a real ``moorline serve``."""

import logging
from typing import Any

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.settings import Settings
from moorline.types import JSONObject

app = Moorline(Settings())
logger = logging.getLogger(__name__)


@app.workflow("echo")
async def echo(ctx: Context, message: str = "") -> JSONObject:
    return {"message": message}


@app.workflow("chatty", max_attempts=2)
async def chatty(ctx: Context, token: str = "") -> JSONObject:
    # The kind of slip redaction is for: a workflow logging the headers of its upstream call.
    logger.info("calling upstream with headers %s", {"Authorization": f"Bearer {token}"})
    if ctx.attempt == 1:
        raise RuntimeError("the first attempt fails, so the worker logs a retry")
    return {"attempt": ctx.attempt}


@app.workflow("hooked")
async def hooked(ctx: Context, payload: Any, event: str | None = None) -> JSONObject:
    logger.info("delivery %s received", event)
    return {"event": event}
