"""The public gRPC server (asyncio): `pdserve.v1.Generation`, the standard health service and
reflection."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.sampling_params import TokenLogprobs
from pdserve_proto import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc
from router.access_log import GrpcAccessLog
from router.auth import AuthError, Credentials
from router.failures import describe_failure
from router.logs import request_context
from router.output import StreamItem
from router.pools.workers import WorkerStartError
from router.router import Router
from router.tracing import RequestTracer
from router.validation import RequestValidationError, ValidationLimits, validate

log = logging.getLogger(__name__)

# room for a 1 MiB prompt in any encoding; the validator enforces the real limit
MAX_MESSAGE_BYTES = 8 << 20
SERVICE_NAME = "pdserve.v1.Generation"
_STATUS = {
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "internal": grpc.StatusCode.UNAVAILABLE,
    "conflict": grpc.StatusCode.ALREADY_EXISTS,
}


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        router: Router,
        limits: ValidationLimits,
        stats: Callable,
        scale: Callable,
        credentials: Credentials = Credentials(),
        tracer: Optional[RequestTracer] = None,
    ):
        self.router = router
        self.limits = limits
        self._stats = stats
        # async (prefill: Optional[int], decode: Optional[int]) -> (ready prefill, ready decode)
        self._scale = scale
        self.credentials = credentials
        self.tracer = tracer  # router/tracing.py; None: tracing off

    async def _authorize(self, context, admin: bool) -> None:
        metadata = dict(context.invocation_metadata() or ())
        try:
            self.credentials.check(metadata.get("authorization"), admin)
        except AuthError as error:
            self.router.count_refused("unauthorized")
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if error.status == 401
                else grpc.StatusCode.PERMISSION_DENIED
            )
            await context.abort(code, str(error))

    async def Generate(self, request, context):
        await self._authorize(context, admin=False)
        await _refuse_undecodable(request, context)
        try:
            validated = validate(request, self.router.tokenizer, self.limits)
        except RequestValidationError as error:
            self.router.count_refused("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        failure: Optional[tuple[grpc.StatusCode, str]] = None
        with request_context(validated.request_id):
            # past the client's deadline gRPC cancels this handler; closing the stream aborts the
            # workers
            try:
                stream = self.router.generate(validated)
                if self.tracer is not None:
                    traceparent = dict(context.invocation_metadata() or ()).get("traceparent")
                    stream = self.tracer.trace(stream, validated.request_id, traceparent, "grpc")
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        response = _response(validated.request_id, item, validated.prompt_ids)
                        await self.router.writes_released()
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                # a Ray actor died or similar: the client gets a status, never a hang
                kind, message = describe_failure(error, validated.request_id)
                if kind == "overloaded":
                    context.set_trailing_metadata((("retry-after-s", "1"),))
                failure = (_STATUS[kind], message)
        if failure is not None:
            await context.abort(*failure)

    async def Abort(self, request, context):
        await self._authorize(context, admin=False)
        await _refuse_undecodable(request, context)
        return pb.AbortResponse(found=await self.router.abort(request.request_id))

    async def GetStats(self, request, context):
        await self._authorize(context, admin=False)
        return await self._stats()

    async def Scale(self, request, context):
        await self._authorize(context, admin=True)
        await _refuse_undecodable(request, context)
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        try:
            ready_prefill, ready_decode = await self._scale(prefill, decode)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except WorkerStartError as error:  # no room for the new workers
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return pb.ScaleResponse(prefill=ready_prefill, decode=ready_decode)


class _Undecodable:
    """A request whose bytes are not its message type: refused in the handler with INVALID_ARGUMENT
    (a deserializer that raises makes gRPC answer UNKNOWN)."""

    def __init__(self, message: str):
        self.message = message


def _tolerant(message_type) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return _Undecodable(
                f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {error}"
            )

    return parse


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _add_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """The generated `add_GenerationServicer_to_server`, with request parsing that never raises."""
    methods = {
        "Generate": (grpc.unary_stream_rpc_method_handler, pb.GenerateRequest, pb.GenerateResponse),
        "Abort": (grpc.unary_unary_rpc_method_handler, pb.AbortRequest, pb.AbortResponse),
        "GetStats": (grpc.unary_unary_rpc_method_handler, pb.GetStatsRequest, pb.GetStatsResponse),
        "Scale": (grpc.unary_unary_rpc_method_handler, pb.ScaleRequest, pb.ScaleResponse),
    }
    handlers = {
        name: handler(
            getattr(servicer, name),
            request_deserializer=_tolerant(request),
            response_serializer=response.SerializeToString,
        )
        for name, (handler, request, response) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _response(request_id: str, item: StreamItem, prompt_ids: list[int]) -> "pb.GenerateResponse":
    response = pb.GenerateResponse(request_id=request_id, token_ids=item.token_ids, text=item.text)
    if item.logprobs is not None:
        response.logprobs.extend(_token_logprob(value) for value in item.logprobs)
    if item.prompt_logprobs is not None:
        response.prompt_logprobs.extend(
            _token_logprob(value, token_id)
            for value, token_id in zip(item.prompt_logprobs, prompt_ids)
        )
    final = item.final
    if final is not None:
        response.finish_reason = final.finish_reason
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=final.prompt_tokens,
                completion_tokens=final.completion_tokens,
                cached_prompt_tokens=final.cached_prompt_tokens,
            )
        )
        response.timings.CopyFrom(
            pb.Timings(
                ttft_s=final.ttft_s,
                tpot_s=final.tpot_s,
                queue_s=final.queue_s,
                prefill_s=final.prefill_s,
                kv_bytes=final.kv_bytes,
                kv_transfer_s=final.kv_transfer_s,
                e2e_s=final.e2e_s,
                decode_step_s=final.decode_step_s,
            )
        )
        response.prefill_worker = final.prefill_worker
        response.decode_worker = final.decode_worker
    return response


def _token_logprob(value: Optional[TokenLogprobs], token_id: int = 0) -> "pb.TokenLogprob":
    if value is None:  # the first prompt token
        return pb.TokenLogprob(token_id=token_id)
    return pb.TokenLogprob(
        token_id=value.token_id,
        logprob=value.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in value.top],
    )


async def start_grpc_server(
    servicer: GenerationServicer,
    host: str,
    port: int,
    tls: Optional[tuple[str, str]] = None,
    access_log: bool = False,
) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Starts serving (TLS when `tls` is (certificate file, key file), both PEM); returns the
    server, the bound port (port 0 picks one) and the health servicer, which reports NOT_SERVING
    until the caller marks the system ready. `access_log`: a line per call
    (router/access_log.py)."""
    # so_reuseport off: with it (gRPC's default on Linux) a second server binds a running one's port
    # and the two split its clients silently.
    server = grpc.aio.server(
        interceptors=[GrpcAccessLog()] if access_log else None,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    _add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        certificate, key = (open(path, "rb").read() for path in tls)
        bound = server.add_secure_port(
            f"{host}:{port}", grpc.ssl_server_credentials([(key, certificate)])
        )
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await _set_status(health_servicer, name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, bound, health_servicer


async def _set_status(health_servicer, service: str, status) -> None:
    await health_servicer.set(service, status)


async def mark_serving(health_servicer, serving: bool = True) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        await _set_status(health_servicer, name, status)
