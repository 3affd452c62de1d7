"""The workflows the API tests trigger. The API only validates against them; none ever runs."""

from typing import Any

from moorline.engine.context import Context
from moorline.engine.registry import Moorline
from moorline.settings import Settings
from moorline.types import JSONObject

app = Moorline(Settings())


@app.workflow("echo")
async def echo(ctx: Context, message: str = "") -> JSONObject:
    return {"message": message}


@app.workflow("add", max_attempts=5, timeout=60)
async def add(ctx: Context, a: int, b: int) -> JSONObject:
    return {"sum": a + b}


@app.workflow("review")
async def review(ctx: Context, payload: Any, event: str | None = None) -> JSONObject:
    return {"event": event}
