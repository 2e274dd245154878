"""A request attempt's chunks as its decode worker sent them, read from its inbox
(router/token_stream.py). With `coalesce`, chunks that queued up while this stream was behind (a
busy router) leave as one, so a backlog costs one message, not one per step, and a chunk waits until
it holds `stream_interval` tokens (or ends the request). Requests with stop strings are not
coalesced: the router may end them on a token in the middle of a chunk. A chunk with an error fails
the attempt: `WorkerLost` (it migrates) when the KV handoff failed because its prefill worker died,
else `WorkerError`."""

from __future__ import annotations

from typing import AsyncIterator

from protocol.token_stream import TokenChunk
from router.failures import RequestAborted, WorkerError, WorkerLost
from router.registry import Route
from router.token_stream import joined, open_chunk
from router.worker_client import WorkerClient


async def read_chunks(
    route: Route, client: WorkerClient, stream_interval: int = 1, coalesce: bool = True
) -> AsyncIterator[TokenChunk]:
    stream = route.inbox
    # The first chunk is never held back: it is the first token (colocated), or the one that tells
    # the router the KV arrived (disaggregated), which frees the prefill worker's blocks.
    wanted = 1
    pending = None
    while True:
        chunk, pending = (pending if pending is not None else await stream.get()), None
        while (
            coalesce and open_chunk(chunk) and (len(chunk.token_ids) < wanted or not stream.empty())
        ):
            following = await stream.get()  # at once when one is queued
            if not isinstance(following, TokenChunk) or following.error is not None:
                pending = following  # handled on its own, next
                break
            chunk = joined(chunk, following)
        if isinstance(chunk, (WorkerLost, RequestAborted)):
            raise chunk
        if chunk.error is not None:  # the abort sent on the way out clears anything left behind
            if (
                not route.prefill_released
                and route.prefill is not None
                and not await client.alive(route.prefill)
            ):
                raise WorkerLost(route.prefill, f"its KV handoff failed ({chunk.error})")
            raise WorkerError(chunk.error)
        if chunk.finish_reason is not None:
            route.decode_finished = True
        yield chunk
        if chunk.finish_reason is not None:
            return
        wanted = stream_interval
