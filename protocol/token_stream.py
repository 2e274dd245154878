"""A decode worker's token stream to the router: `TokenChunk`s, one message per engine step, over a
gRPC server stream (msgpack, identity serializer)."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import msgpack

from protocol.messages import WorkerCosts

# (token id, logprob, ((token id, logprob), ...)): engine.sampling_params.TokenLogprobs
WireLogprobs = tuple


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request from a decode (or colocated) worker; the last one has a finish
    reason."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # the request failed on the worker (message says why)
    # time.time() the KV became ready (first chunk, disaggregated)
    kv_ready_wall_s: Optional[float] = None
    num_cached_prompt_tokens: int = 0
    # Asked for by the request: one (token id, logprob, ((token id, logprob), ...) top) per token of
    # `token_ids` (engine.sampling_params.TokenLogprobs, as plain tuples: this package imports no
    # engine).
    logprobs: Optional[tuple[WireLogprobs, ...]] = None
    # Colocated, with the first token: one per prompt token, the first None.
    prompt_logprobs: Optional[tuple[Optional[WireLogprobs], ...]] = None
    # With the last chunk: the mean engine decode step (forward and sampling) while the request
    # decoded here, as the worker timed it (the gRPC API's Timings.decode_step_s)
    decode_step_s: Optional[float] = None


# A decode worker's token stream to the router: the gRPC server-streaming method below, one message
# per engine step: [every request's chunk (msgpack lists of TokenChunk's fields, in field order),
# the step's KV hash events ([stored?, hash] pairs: engine/block_manager.py), the worker's costs
# after the step (WorkerCosts's fields, in field order)], after a first message that says the
# subscription is in place: [OUTPUT_STREAM_VERSION, worker id, the block hashes it holds at that
# moment].
OUTPUT_STREAM_SERVICE = "pdserve.internal.v1.DecodeOutputs"
OUTPUT_STREAM_METHOD = f"/{OUTPUT_STREAM_SERVICE}/Subscribe"
# 3: chunks carry logprobs; 4: the last one the mean decode step; 5: each message the worker's costs
OUTPUT_STREAM_VERSION = 5

# (True, hash): the worker now holds a block with this hash; False: no longer
KVEvent = tuple[bool, bytes]


_chunk_fields = operator.attrgetter(*(f.name for f in fields(TokenChunk)))
_cost_fields = operator.attrgetter(*(f.name for f in fields(WorkerCosts)))


def encode_chunks(
    chunks: Sequence[TokenChunk],
    kv_events: Sequence[KVEvent] = (),
    costs: WorkerCosts = WorkerCosts(),
) -> bytes:
    return msgpack.packb(
        [[_chunk_fields(chunk) for chunk in chunks], kv_events, _cost_fields(costs)]
    )


def decode_chunks(data: bytes) -> tuple[list[TokenChunk], list[KVEvent], WorkerCosts]:
    chunks, kv_events, costs = msgpack.unpackb(data)
    return (
        [_chunk(request_id, token_ids, *rest) for request_id, token_ids, *rest in chunks],
        [(bool(stored), block_hash) for stored, block_hash in kv_events],
        WorkerCosts(*costs),
    )


def _chunk(request_id, token_ids, *rest) -> TokenChunk:
    chunk = TokenChunk(request_id, tuple(token_ids), *rest)
    if chunk.logprobs is None and chunk.prompt_logprobs is None:
        return chunk
    return dataclasses.replace(
        chunk,
        logprobs=wire_logprobs(chunk.logprobs),
        prompt_logprobs=wire_logprobs(chunk.prompt_logprobs),
    )


def wire_logprobs(values) -> Optional[tuple]:
    """Logprobs as msgpack gives them back (arrays as lists) made tuples again (None stays None)."""
    if values is None:
        return None
    return tuple(
        None if v is None else (v[0], v[1], tuple((t, lp) for t, lp in v[2])) for v in values
    )


def encode_hello(worker_id: str, held_hashes: Sequence[bytes]) -> bytes:
    return msgpack.packb([OUTPUT_STREAM_VERSION, worker_id, list(held_hashes)])


def decode_hello(data: bytes) -> tuple[int, str, list[bytes]]:
    version, worker_id, *rest = msgpack.unpackb(data)
    return version, worker_id, (rest[0] if rest else [])
