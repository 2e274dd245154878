"""A decode worker's token stream to the router: `TokenChunk`s, one message per engine step, over a gRPC
server stream (msgpack, identity serializer)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import msgpack


@dataclass(frozen=True)
class TokenChunk:
    """New tokens of one request from a decode (or colocated) worker; the last one has a finish reason."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # the request failed on the worker (message says why)
    kv_ready_wall_s: Optional[float] = None  # time.time() the KV became ready (first chunk, disaggregated)
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
