"""The access log: one line per HTTP request and per gRPC call, refusals included, on the
`pdserve.access` logger (on by default; `pdserve serve --no-access-log` leaves both hooks out).

    http POST /v1/completions 200 0.412s peer=127.0.0.1 request_id=3f2a… trace_id=4bf9…
    grpc /pdserve.v1.Generation/Generate OK 1.020s peer=ipv4:127.0.0.1:5123 request_id=r1 trace_id=-

An aiohttp middleware (outermost, so it sees the status the error middleware made) and a gRPC server
interceptor time each request and write its line when it ends; a streamed one when its last byte is
sent. A client that goes away is status 499 (HTTP) or CANCELLED (gRPC). The request id is the one
the request is served under (`router.logs.request_context` fills it in, one the server made
too); the trace id is the W3C `traceparent`'s the client sent, or the trace the router started.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Optional

import grpc
from aiohttp import web

from router.logs import AccessEntry, access_entry
from router.trace_context import trace_id_of

log = logging.getLogger("pdserve.access")
# HTTP status of a request whose client disconnected before the answer ended (nginx's)
CLIENT_CLOSED = 499


def _write(protocol: str, target: str, status, started_s: float, peer, entry) -> None:
    elapsed_s = time.perf_counter() - started_s
    log.info(
        "%s %s %s %.3fs peer=%s request_id=%s trace_id=%s",
        protocol,
        target,
        status,
        elapsed_s,
        peer or "-",
        entry.request_id,
        entry.trace_id,
        extra={"request_id": entry.request_id},
    )


@web.middleware
async def http_access_log(request: web.Request, handler) -> web.StreamResponse:
    started_s = time.perf_counter()
    entry = AccessEntry(
        request_id=request.headers.get("X-Request-Id", "-")[:256],
        trace_id=trace_id_of(request.headers.get("traceparent")) or "-",
    )
    token = access_entry.set(entry)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = CLIENT_CLOSED
        raise
    finally:
        access_entry.reset(token)
        _write(
            "http", f"{request.method} {request.path_qs}", status, started_s, request.remote, entry
        )


class GrpcAccessLog(grpc.aio.ServerInterceptor):
    """Wraps every method's behavior (the public API's, health's and reflection's)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: _logged(behavior, details.method)})
        return handler


def _start(request, context) -> AccessEntry:
    metadata = dict(context.invocation_metadata() or ())
    return AccessEntry(
        request_id=getattr(request, "request_id", "") or "-",  # a refused request's too
        trace_id=trace_id_of(metadata.get("traceparent")) or "-",
    )


def _status(context, error: Optional[BaseException]) -> str:
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if code is None:
        return "OK" if error is None else "UNKNOWN"
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


def _logged(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):

        async def streamed(request, context):
            started_s, entry, error = time.perf_counter(), _start(request, context), None
            access_entry.set(entry)  # each call is a task of its own: nothing to reset
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as caught:
                error = caught
                raise
            finally:
                _write("grpc", method, _status(context, error), started_s, context.peer(), entry)

        return streamed

    async def called(request, context):
        started_s, entry, error = time.perf_counter(), _start(request, context), None
        access_entry.set(entry)
        try:
            return await behavior(request, context)
        except BaseException as caught:
            error = caught
            raise
        finally:
            _write("grpc", method, _status(context, error), started_s, context.peer(), entry)

    return called
