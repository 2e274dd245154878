"""The OpenAI-compatible HTTP server (aiohttp), next to the gRPC server on the router's event loop.

Routes: `POST /v1/completions` (a prompt, or an array of prompts answered as one response),
`POST /v1/chat/completions` (SSE when `stream: true`), `GET /v1/models`, vLLM's `POST /tokenize`,
`POST /detokenize` and `GET /version`, `GET /health`, `GET /metrics` (Prometheus text),
`POST /admin/scale` (admin token).
Every error is a JSON body in OpenAI's shape with the right status: 400 bad input, 401/403 keys, 404
unknown model or route, 413 too large, 415 not JSON, 429 overloaded (with Retry-After), 503 no
worker, 504 deadline. A client that disconnects cancels its handler, which aborts the request on its
workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from aiohttp import web

from router import openai_tokens
from router.access_log import http_access_log
from router.auth import AuthError, Credentials
from router.choices import Choices, best, generate_choices
from router.failures import describe_failure
from router.logs import request_context
from router.metrics import METRICS_CONTENT_TYPE, Snapshot
from router.openai_api import (
    SSE_DONE,
    ApiError,
    ParsedRequest,
    ResponseShape,
    invalid,
    openai_param,
    parse_body,
    parse_request,
    sse,
)
from router.openai_logprobs import TokenTexts
from router.output import FinalInfo, StreamItem
from router.pools.workers import WorkerStartError
from router.router import Router
from router.tracing import RequestTracer
from router.validation import (
    MAX_REQUEST_ID_CHARS,
    RequestValidationError,
    ValidatedRequest,
    ValidationLimits,
    validate,
)

log = logging.getLogger(__name__)

# as the gRPC server's message limit; the validator enforces the prompt limit
MAX_BODY_BYTES = 8 << 20


@dataclass
class HttpFrontend:
    router: Router
    limits: ValidationLimits
    served_model: str
    credentials: Credentials
    snapshot: Callable[[], Awaitable[Snapshot]]  # current pools and loads, for /metrics
    scale: Callable[[Optional[int], Optional[int]], Awaitable[tuple[int, int]]]
    ready: Callable[[], bool]
    access_log: bool = True  # router/access_log.py
    tracer: Optional[RequestTracer] = None  # router/tracing.py; None: tracing off
    started_s: float = 0.0
    _texts: Optional[TokenTexts] = None  # token texts for logprobs, shared by all requests

    def app(self) -> web.Application:
        middlewares = [http_access_log] if self.access_log else []
        app = web.Application(
            client_max_size=MAX_BODY_BYTES, middlewares=[*middlewares, self._errors]
        )
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/version", self.version),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
                web.post("/admin/scale", self.admin_scale),
            ]
        )
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every failure becomes an OpenAI-shaped JSON error (aiohttp's own 404/405/413
        included)."""
        try:
            return await handler(request)
        except ApiError as error:
            return _error_response(error)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return _error_response(
                ApiError(error.status, f"{error.reason}: {request.method} {request.path}")
            )

    # -- data plane ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        self._authorize(request, admin=False)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model,
                        "object": "model",
                        "created": int(self.started_s),
                        "owned_by": "pdserve",
                        "max_model_len": self.limits.max_context_tokens,
                    }
                ],
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._tokens_body(request)
        reply = openai_tokens.tokenize(body, self.router.tokenizer, self.limits.max_context_tokens)
        return web.json_response(reply)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._tokens_body(request)
        reply = openai_tokens.detokenize(body, self.router.tokenizer, self.limits.vocab_size)
        return web.json_response(reply)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response(openai_tokens.version())

    async def _tokens_body(self, request: web.Request) -> dict:
        """/tokenize and /detokenize: a data-plane key, and the served model if one is named."""
        self._authorize(request, admin=False)
        body = parse_body(await request.read())
        model = body.get("model")
        if model is not None and model != self.served_model:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.served_model}`",
                "model",
                "model_not_found",
            )
        return body

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
            raise ApiError(
                400,
                f"X-Request-Id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters",
                "X-Request-Id",
            )
        with request_context(request_id):
            try:
                self._authorize(request, admin=False)
                parsed, validated = await self._parse(request, chat, request_id)
            except ApiError as error:
                self.router.count_refused(
                    "unauthorized" if error.status in (401, 403) else "invalid"
                )
                raise
            shape = self._shape(parsed, validated)
            stream = generate_choices(self.router, validated, parsed.choices)
            request_id = validated[0].request_id
            if self.tracer is not None:
                traceparent = request.headers.get("traceparent")
                stream = self.tracer.trace(stream, request_id, traceparent, "http")
            async with contextlib.aclosing(stream):
                try:
                    # failures before the first token still get their own status
                    first = await anext(stream)
                except Exception as error:
                    raise _api_error(error, request_id) from error
                total = len(validated) * parsed.choices.best_of
                if not parsed.stream:
                    return await _whole(stream, first, shape, request_id, parsed.choices, total)
                return await _event_stream(request, stream, first, shape, request_id, self.router)

    def _shape(self, parsed: ParsedRequest, validated: list[ValidatedRequest]) -> ResponseShape:
        if self._texts is None:
            self._texts = TokenTexts(self.router.tokenizer)
        prompt_texts = [
            (asked.text or self.router.tokenizer.decode(one.prompt_ids)) if parsed.echo else ""
            for asked, one in zip(parsed.requests, validated)
        ]
        return ResponseShape(
            parsed,
            self.served_model,
            validated[0].request_id,
            self._texts,
            [one.prompt_ids for one in validated],
            prompt_texts,
        )

    async def _parse(
        self, request: web.Request, chat: bool, request_id: str
    ) -> tuple[ParsedRequest, list[ValidatedRequest]]:
        """The request, and each of its prompts validated (one but for a batch of completions)."""
        if request.content_type != "application/json":
            raise ApiError(
                415,
                f"Content-Type must be application/json, got {request.content_type or 'none'!r}",
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as error:
            raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes") from error
        parsed = parse_request(parse_body(raw), chat, self.served_model, request_id)
        validated = []
        for index, one in enumerate(parsed.requests):
            try:
                validated.append(validate(one, self.router.tokenizer, self.limits))
            except RequestValidationError as error:
                which = (
                    f"prompt[{index}]: "
                    if parsed.batch and error.field.startswith("prompt")
                    else ""
                )
                raise invalid(openai_param(error.field, parsed), which + error.reason) from error
        return parsed, validated

    # -- operations ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready():
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        snapshot = None  # the last one, unless a new one comes in time
        try:
            snapshot = await asyncio.wait_for(self.snapshot(), timeout=5.0)
        except asyncio.TimeoutError:
            log.warning(
                "/metrics: the workers' loads did not arrive within 5 s; serving the last snapshot"
            )
        return web.Response(
            body=self.router.render_metrics(snapshot),
            headers={"Content-Type": METRICS_CONTENT_TYPE},
        )

    async def admin_scale(self, request: web.Request) -> web.Response:
        self._authorize(request, admin=True)
        body = parse_body(await request.read())
        sizes = {}
        for role in ("prefill", "decode"):
            value = body.get(role)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise invalid(role, f"must be a non-negative integer, got {value!r}")
            sizes[role] = value
        if set(body) - set(sizes):
            raise invalid(
                sorted(set(body) - set(sizes))[0], "unrecognized argument (prefill, decode)"
            )
        try:
            prefill, decode = await self.scale(sizes["prefill"], sizes["decode"])
        except ValueError as error:
            raise ApiError(400, str(error)) from error
        except WorkerStartError as error:  # no room for the new workers
            raise ApiError(409, str(error)) from error
        return web.json_response({"prefill": prefill, "decode": decode})

    def _authorize(self, request: web.Request, admin: bool) -> None:
        try:
            self.credentials.check(request.headers.get("Authorization"), admin)
        except AuthError as error:
            raise ApiError(error.status, str(error), code=error.code) from error


async def _whole(
    stream,
    first: tuple[int, StreamItem],
    shape: ResponseShape,
    request_id: str,
    choices: Choices,
    total: int,
) -> web.Response:
    """`total` choices: best_of per prompt."""
    generated: list[list[StreamItem]] = [[] for _ in range(total)]
    finished = 0
    index, item = first
    try:
        while True:
            generated[index].append(item)
            finished += item.final is not None
            if finished == total:
                break
            index, item = await anext(stream)
    except Exception as error:
        raise _api_error(error, request_id) from error
    if choices.best_of > choices.n:
        generated = best(generated, choices)
    return web.json_response(shape.full(generated))


async def _event_stream(
    request: web.Request,
    stream,
    first: tuple[int, StreamItem],
    shape: ResponseShape,
    request_id: str,
    router: Router,
) -> web.StreamResponse:
    """Each choice's chunks carry its index, interleaved as they come; with include_usage the usage
    chunk follows the last choice's final one."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": request_id,
        }
    )
    await response.prepare(request)
    # streamed: best_of == n
    num_choices = shape.parsed.choices.best_of * len(shape.parsed.requests)
    (index, item), opened = first, set()
    # per choice: items not sent yet (tokens without text so far: their logprobs wait too)
    pending: dict[int, list[StreamItem]] = {}
    finals: dict[int, FinalInfo] = {}
    try:
        while True:
            waiting = pending.setdefault(index, [])
            waiting.append(item)
            opening = index not in opened
            if item.text or item.final is not None or opening:
                event = sse(shape.chunk(waiting, first=opening, index=index))
                pending[index] = []
                await router.writes_released()
                await response.write(event)
                opened.add(index)
            if item.final is not None:
                finals[index] = item.final
                if len(finals) == num_choices:
                    if shape.parsed.include_usage:
                        in_order = [finals[i] for i in sorted(finals)]
                        await response.write(sse(shape.usage_chunk(in_order)))
                    break
            index, item = await anext(stream)
    except ConnectionResetError:
        raise  # the client went away: closing the stream aborts the request on its workers
    except Exception as error:  # headers are sent: the error goes in the stream, as OpenAI does
        await response.write(sse(_api_error(error, request_id).body()))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


_STATUS = {"unavailable": 503, "overloaded": 429, "deadline": 504, "internal": 500, "conflict": 409}


def _api_error(error: Exception, request_id: str) -> ApiError:
    if isinstance(error, ApiError):
        return error
    kind, message = describe_failure(error, request_id)
    return ApiError(
        _STATUS[kind],
        message,
        code="overloaded" if kind == "overloaded" else None,
        param="X-Request-Id" if kind == "conflict" else None,
    )


def _error_response(error: ApiError) -> web.Response:
    headers = {429: {"Retry-After": "1"}, 401: {"WWW-Authenticate": "Bearer"}}.get(error.status)
    return web.json_response(error.body(), status=error.status, headers=headers)


async def start_http_server(
    frontend: HttpFrontend, host: str, port: int, ssl_context=None
) -> tuple[web.AppRunner, int]:
    """Starts serving; returns the runner (`await runner.cleanup()` stops it) and the bound port."""
    frontend.started_s = time.time()
    runner = web.AppRunner(frontend.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # port 0 picks a free one
    return runner, bound
