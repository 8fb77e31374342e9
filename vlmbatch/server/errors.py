"""OpenAI-style error bodies, and the rule that a client's mistake is never a 500.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`, the
shape the `openai` client parses into its exception types. Per-request problems raised
anywhere below (`RowError` from chat parsing, media loading or the model adapter) map to
400 with the `ErrorType` value as `code` and the faulty part as `param`; only the engine
failing, which is the server's fault, is a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmbatch.errors import ErrorType, RowError

logger = logging.getLogger(__name__)

# RowErrors that are the server's fault; every other RowError is the client's (400).
_SERVER_FAULTS = {ErrorType.ENGINE, ErrorType.WORKER_CRASH}


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def from_row_error(cls, error: RowError) -> "APIError":
        if error.error_type in _SERVER_FAULTS:
            return cls(500, error.message, type="server_error", param=error.param, code=error.error_type)
        return cls(400, error.message, param=error.param, code=error.error_type)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's error list → one readable message; `param` is the first bad field."""
    problems = []
    param = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            problems.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
            continue
        param = param or where or None
        problems.append(f"{where}: {err['msg']}" if where else err["msg"])
    return APIError(400, "; ".join(problems) or "invalid request", param=param, code="invalid_request")


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through `APIError` so all error bodies share the OpenAI shape."""

    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return exc.response(headers)

    async def on_row_error(_: Request, exc: RowError) -> JSONResponse:
        return APIError.from_row_error(exc).response()

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RowError, on_row_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
