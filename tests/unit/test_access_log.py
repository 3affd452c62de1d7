"""MOORLINE_ACCESS_LOG=errors: uvicorn's access line for responses of 400 and more only."""

import logging

import httpx
import pytest
from fastapi import FastAPI

from moorline.api.access import ACCESS_LOGGER, ErrorAccessLog


def app_answering_by_path() -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/boom")
    async def boom() -> dict[str, str]:
        raise RuntimeError("a bug")

    return app


async def test_only_refused_and_failed_requests_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logged = ErrorAccessLog(app_answering_by_path())
    transport = httpx.ASGITransport(app=logged, raise_app_exceptions=False)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            assert (await client.get("/ok")).status_code == 200
            assert (await client.get("/missing?marker=a b")).status_code == 404
            # Answered by Starlette's ServerErrorMiddleware, inside the access log.
            assert (await client.get("/boom")).status_code == 500
    lines = [record.getMessage() for record in caplog.records if record.name == ACCESS_LOGGER]
    # uvicorn's own format: client, request line, status.
    assert lines == [
        '127.0.0.1:123 - "GET /missing?marker=a%20b HTTP/1.1" 404',
        '127.0.0.1:123 - "GET /boom HTTP/1.1" 500',
    ]
