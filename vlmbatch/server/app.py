"""The FastAPI application behind `vlmbatch serve`.

Routes: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /version`,
`GET /metrics` (Prometheus).
With an API key every `/v1/*` path, known or not, needs `Authorization: Bearer KEY`.
A client that disconnects cancels its handler, which aborts its engine request.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from vlmbatch import __version__
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from vlmbatch.engine.base import Engine
from vlmbatch.errors import JobError, RowError
from vlmbatch.families.adapter import ModelAdapter
from vlmbatch.server.async_engine import AsyncEngine
from vlmbatch.server.completions import ChatCompletions
from vlmbatch.server.errors import APIError, install_error_handlers
from vlmbatch.server.media import ServerMedia
from vlmbatch.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, CountResponses, ServerMetrics
from vlmbatch.server.protocol import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList
from vlmbatch.server.settings import ServerSettings

T = TypeVar("T")

# nginx's "client closed request": logged for requests whose client left before the answer.
CLIENT_CLOSED_REQUEST = 499


class BearerAuth:
    """ASGI middleware: `/v1/*` answers 401 (OpenAI error body) without the right bearer token.

    A middleware rather than a route dependency so unknown `/v1` paths are refused too
    instead of revealing which routes exist.
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            sent = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(sent, self.expected):
                error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`, cancelling it (and so aborting its engine request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


def require_chat_template(adapter: ModelAdapter) -> None:
    """Refuse to start rather than fail every request: chat needs a template."""
    try:
        adapter.apply_chat_template([{"role": "user", "content": "ping"}])
    except RowError as exc:
        raise JobError(f"cannot serve chat: {exc.message}") from exc


def create_app(adapter: ModelAdapter, engine: Engine, settings: ServerSettings) -> FastAPI:
    """The app serving `engine` (started and stopped with the app's lifespan).

    Raises `JobError` when the model cannot chat (no chat template) or a media option is wrong.
    """
    require_chat_template(adapter)
    try:
        media = ServerMedia(settings, adapter.frame_convention)
    except ValueError as exc:
        raise JobError(str(exc)) from exc
    metrics = ServerMetrics(engine.load)
    async_engine = AsyncEngine(engine, metrics=metrics)
    completions = ChatCompletions(adapter, async_engine, media, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            completions.close()
            media.close()

    app = FastAPI(title="vlmbatch", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    app.add_middleware(CountResponses, metrics=metrics)  # outermost: refused requests count too

    @app.exception_handler(ClientGone)
    async def on_client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "requests_in_flight": async_engine.num_in_flight}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus exposition (docs/serve.md lists the metrics); outside /v1, so no API key."""
        return Response(metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_id)])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion | StreamingResponse:
        prepared = await until_disconnected(request, completions.prepare(body))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = completions.stream(prepared, include_usage, created=int(time.time()))
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        return await until_disconnected(request, completions.complete(prepared))

    return app
