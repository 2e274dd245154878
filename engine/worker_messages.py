"""The small typed messages that cross the router <-> worker boundary. No torch: the router imports them."""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

import msgpack


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns as soon as a prompt's first token is sampled."""

    request_id: str
    worker_id: str
    first_token_id: int
    finish_reason: Optional[str]  # set when the request already finished at its first token
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    queue_s: float
    prefill_s: float
    kv_bytes: int
    kv_sent_wall_s: float  # time.time() the KV handoff started (wall clock: comparable across processes)
    deliveries: tuple[Any, ...] = ()  # routed transport messages (ray: header + ObjectRef); () in-band


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request from a decode (or colocated) worker; the last one has a finish reason."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # the request failed on the worker (message says why)
    kv_ready_wall_s: Optional[float] = None  # time.time() the KV became ready (first chunk, disaggregated)
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0


# A decode worker's token stream to the router: the gRPC server-streaming method below, one message per
# engine step with every request's chunk (msgpack lists of TokenChunk's fields, in field order), after a
# first message that says the subscription is in place: [OUTPUT_STREAM_VERSION, worker id].
OUTPUT_STREAM_SERVICE = "pdserve.internal.v1.DecodeOutputs"
OUTPUT_STREAM_METHOD = f"/{OUTPUT_STREAM_SERVICE}/Subscribe"
OUTPUT_STREAM_VERSION = 1


_chunk_fields = operator.attrgetter(*(f.name for f in fields(TokenChunk)))


def encode_chunks(chunks: Sequence[TokenChunk]) -> bytes:
    return msgpack.packb([_chunk_fields(chunk) for chunk in chunks])


def decode_chunks(data: bytes) -> list[TokenChunk]:
    return [TokenChunk(request_id, tuple(token_ids), *rest) for request_id, token_ids, *rest in msgpack.unpackb(data)]


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    node: str
    kv_address: Optional[str]  # where KV senders reach this worker (grpc transport), else None
    kv_blocks_total: int
    max_context_tokens: int  # what this worker serves: the model's context, or less if its KV cache holds less
    vocab_size: int
    model_context_tokens: int = 0  # the model's own context
    num_threads: int = 1  # torch threads the worker computes with
    dtype: str = "float32"  # the serving dtype, "auto" resolved: every worker of a system must agree


@dataclass(frozen=True)
class GpuStats:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1, NVML's "percent of time a kernel ran" over its last sample period


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    running_requests: int
    waiting_requests: int
    kv_blocks_free: int
    kv_blocks_total: int
    requests_served: int
    max_batch_size_seen: int
    decode_steps: int = 0  # steps that decoded only (no prefill) since start, and their total time
    decode_steps_s: float = 0.0
    rss_bytes: int = 0  # the worker process's resident memory
    gpus: tuple[GpuStats, ...] = ()
    gpu_note: str = ""  # why `gpus` is empty ("no GPU (...)")
