"""Per-request traces with OpenTelemetry, exported by OTLP (`pdserve serve --otlp-endpoint`).

Off by default, and then free: nothing here imports the SDK, the front ends hold no tracer (None)
and create no span objects. On, a front end wraps each request's stream in `RequestTracer.follow`:
the request's root span (`pdserve.request`, a child of the client's W3C `traceparent` — HTTP header
or gRPC metadata — or the root of a new trace) opens when the request arrives, and when its final
item comes its phases are recorded as child spans, timed from what the router and the workers
measured (`router.output.FinalInfo`):

    pdserve.request         request id, prompt / completion / cached tokens, finish reason,
                            the PD decision and its reason, the workers
      admission_queue       received → prefill started
      prefill               prompt and cached tokens, the prefill worker (or the decode worker
                            when the PD policy prefilled locally)
      kv_transfer           KV bytes, wire mode and bytes on the wire: send started → installed
      decode                completion tokens, the decode worker's mean step
    and an `abort` event when the client or `Abort` ended it, an error status when it failed.

The workers' phases are recorded in the router from their reported timings, so one trace needs
one exporter; the trace id is known from the start, so the access log names it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Optional

from router.logs import access_entry
from router.output import FinalInfo, StreamItem

SERVICE_NAME = "pdserve-router"
# how long finished spans wait to be batched into one OTLP export
EXPORT_DELAY_S = 0.5


class RequestTracer:
    """Turns a request's stream into its spans; one per system, built by `start_tracing`."""

    def __init__(self, provider):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer = provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Exports what is left (the system is stopping)."""
        self._provider.shutdown()

    def trace(
        self, stream: AsyncIterator, request_id: str, traceparent: Optional[str], api: str
    ) -> AsyncIterator:
        """`stream` traced: its root span opens now, and the access log names its trace."""
        span = self.start(request_id, traceparent, api)
        entry = access_entry.get()
        if entry is not None:
            entry.trace_id = trace_id_hex(span)
        return self.follow(span, stream)

    def start(self, request_id: str, traceparent: Optional[str], api: str):
        """The request's root span, opened now (its trace id: `trace_id_hex`)."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        return self._tracer.start_span(
            "pdserve.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"pdserve.request_id": request_id, "pdserve.api": api},
        )

    async def follow(self, span, stream: AsyncIterator) -> AsyncIterator:
        """`stream` (of StreamItem, or (choice, StreamItem) for several choices) passed through;
        each final item's phases become spans under `span`, which ends with the stream."""
        from opentelemetry.trace import Status, StatusCode

        started_ns = span.start_time  # wall-clock ns; the router's timings count from about then
        try:
            async with contextlib.aclosing(stream):  # closing this closes it: workers aborted
                async for element in stream:
                    item = element[1] if isinstance(element, tuple) else element
                    if isinstance(item, StreamItem) and item.final is not None:
                        self._phases(span, started_ns, item.final)
                    yield element
        except (GeneratorExit, asyncio.CancelledError):
            span.add_event("abort", {"pdserve.abort.by": "client gone"})
            raise
        except BaseException as error:
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            raise
        finally:
            span.end()

    def _phases(self, root, started_ns: int, final: FinalInfo) -> None:
        from opentelemetry import trace

        def at(offset_s: float) -> int:
            return started_ns + int(offset_s * 1e9)

        path, _, reason = final.pd_decision.partition(" ")
        root.set_attributes(
            {
                "pdserve.finish_reason": final.finish_reason,
                "pdserve.prompt_tokens": final.prompt_tokens,
                "pdserve.completion_tokens": final.completion_tokens,
                "pdserve.cached_prompt_tokens": final.cached_prompt_tokens,
                "pdserve.pd.path": path or "colocated",
                "pdserve.pd.reason": reason.strip("()") or "-",
                "pdserve.prefill_worker": final.prefill_worker,
                "pdserve.decode_worker": final.decode_worker,
            }
        )
        if final.finish_reason == "abort":
            root.add_event("abort", timestamp=at(final.e2e_s))
        context = trace.set_span_in_context(root)

        def phase(name: str, start_s: float, end_s: float, attributes: dict) -> None:
            span = self._tracer.start_span(
                name, context=context, start_time=at(start_s), attributes=attributes
            )
            span.end(end_time=at(max(start_s, end_s)))

        prefill_end_s = final.queue_s + final.prefill_s
        phase("admission_queue", 0.0, final.queue_s, {})
        phase(
            "prefill",
            final.queue_s,
            prefill_end_s,
            {
                "pdserve.prompt_tokens": final.prompt_tokens,
                "pdserve.cached_prompt_tokens": final.cached_prompt_tokens,
                "pdserve.worker": final.prefill_worker or final.decode_worker,
                "pdserve.pd.decision": final.pd_decision or "-",
            },
        )
        if final.kv_bytes:
            phase(
                "kv_transfer",
                prefill_end_s,
                prefill_end_s + final.kv_transfer_s,
                {
                    "pdserve.kv.bytes": final.kv_bytes,
                    "pdserve.kv.wire": final.kv_wire or "-",
                    "pdserve.kv.wire_bytes": final.kv_wire_bytes,
                },
            )
        phase(
            "decode",
            final.ttft_s,
            final.e2e_s,
            {
                "pdserve.completion_tokens": final.completion_tokens,
                "pdserve.decode_step_s": final.decode_step_s,
                "pdserve.worker": final.decode_worker,
            },
        )


def trace_id_hex(span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def start_tracing(endpoint: str) -> RequestTracer:
    """A tracer exporting by OTLP/gRPC to `endpoint` (host:port, or an http(s) URL). Needs
    `pip install 'pdserve[otel]'`."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise ValueError(
            f"--otlp-endpoint needs OpenTelemetry: pip install 'pdserve[otel]' ({error})"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_S * 1e3)
    )
    return RequestTracer(provider)
