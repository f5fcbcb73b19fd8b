"""The FastAPI application: both APIs' routes over one `Driver`, plus what guards them.

  * auth: with an API key set, every route but /health needs `Authorization: Bearer KEY` or
    `x-api-key: KEY` (compared in constant time), else 401;
  * limits: a request body over `max_body` bytes gets 413, before it is read where its
    Content-Length says so, else once the bytes received pass it (a chunked body, with or
    without a Content-Length, is counted as it arrives); `max_tokens` above the server's limit, or
    past the context with the prompt, 400 (the context's in each API's words: ContextExceeded);
  * errors: every refused request gets the calling API's own error JSON (OpenAI's `error`
    object with `param` naming the field, Anthropic's `{"type": "error", ...}`), 400 for an
    invalid field (never FastAPI's 422);
  * /metrics counts the requests by status, an unhandled error as the 500 it is answered with;
  * /health (200, or 503 while a pipeline's next stage is away: it tries to reach it again
    each time it is asked) and /metrics (Prometheus).
"""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import DEFAULT_MAX_BODY, anthropic_api, openai_api
from .driver import Driver
from .metrics import CONTENT_TYPE_LATEST
from .shared import APIError, ServerState, first_invalid

OPEN_PATHS = ("/health",)
OTHER_ENDPOINT = "other"  # the request counter's label for a path the server does not serve
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, status: int, message: str, param: str | None = None,
                   kind: str | None = None, headers: dict | None = None,
                   code: str | None = None) -> JSONResponse:
    if _is_anthropic(path):
        kind = _ANTHROPIC_KINDS.get(status, kind or "api_error")
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        if kind is None:
            kind = {401: "authentication_error", 429: "rate_limit_error", 404: "not_found_error"}.get(
                status, "invalid_request_error" if status < 500 else "api_error")
        body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(StarletteHTTPException):
    """Raised by the body's reader once it has passed the limit (FastAPI passes an HTTPException
    raised while reading the body on to the app's handler, which answers it)."""

    def __init__(self, max_body: int):
        super().__init__(413, f"the request body is more than {max_body} bytes; this server "
                              f"takes at most {max_body}")


class Guard:
    """ASGI middleware: API key, body size, and the request counter."""

    def __init__(self, app, *, api_key: str | None, max_body: int, metrics, endpoints: dict):
        self.app = app
        # the counter's endpoint labels, each route's path with its compiled pattern; any other
        # path counts as OTHER_ENDPOINT
        self.endpoints = endpoints
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.metrics = metrics

    def _label(self, path: str) -> str:
        """The request counter's endpoint label: a route's path, its template for a route with a
        parameter (/v1/models/{model:path}), else OTHER_ENDPOINT (a client cannot add series)."""
        if path in self.endpoints:
            return path
        return next((route for route, pattern in self.endpoints.items() if pattern.match(path)), OTHER_ENDPOINT)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        status_box = [0]
        received = 0

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        async def limited_receive():
            # the bytes as they come, whatever the headers say: h11 reads a chunked body as
            # chunked even where a Content-Length (checked below) came with it
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        try:
            refusal = None
            if self.key is not None and path not in OPEN_PATHS and not self._authorized(headers):
                refusal = error_response(path, 401, "a valid API key is required: send "
                                                    "'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                         headers={"WWW-Authenticate": "Bearer"})
            elif scope["method"] == "POST":
                # (a body without a length, chunked, is read up to the limit: limited_receive)
                length = headers.get(b"content-length")
                if length is not None and (not length.isdigit() or int(length) > self.max_body):
                    refusal = error_response(path, 413, f"the request body is {length.decode(errors='replace')} "
                                                        f"bytes; this server takes at most {self.max_body}")
            if refusal is not None:
                return await refusal(scope, receive, counting_send)
            return await self.app(scope, limited_receive, counting_send)
        except Exception:
            if status_box[0] == 0:  # (ServerErrorMiddleware, outside this one, answers it)
                status_box[0] = 500
            raise
        finally:
            if path.startswith("/v1/"):
                label = self._label(path)
                self.metrics.requests.labels(label, str(status_box[0])).inc()


def create_app(driver: Driver, *, model_id: str, max_tokens_limit: int, api_key: str | None = None,
               max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    state = ServerState(driver, model_id, max_tokens_limit, int(time.time()))
    app = FastAPI(title="ds4", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ds4 = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        path = request.url.path
        return error_response(path, e.status, e.anthropic_message if _is_anthropic(path) else e.message,
                              e.param, e.kind, e.headers, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            error = APIError(400, "body: the body is not valid JSON", "body")
        else:
            error = first_invalid([{**x, "loc": [k for k in x.get("loc", ()) if k != "body"]} for x in e.errors()])
        return error_response(request.url.path, error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(request.url.path, e.status_code, str(e.detail))

    @app.get("/health")
    async def health():
        if driver.remote and not await asyncio.to_thread(driver.probe):
            return JSONResponse({"status": "unavailable",
                                 "reason": f"{driver.remote_name} is away ({driver.away_reason})"},
                                status_code=503)
        return {"status": "ok", "model": model_id}

    @app.get("/metrics")
    async def metrics():
        return Response(driver.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    openai_api.register(app, state)
    anthropic_api.register(app, state)
    app.add_middleware(Guard, api_key=api_key, max_body=max_body, metrics=driver.metrics,
                       endpoints={route.path: route.path_regex for route in app.routes})
    return app
