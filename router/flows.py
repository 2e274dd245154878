"""The two ways an attempt of a request runs, each an async iterator of stream items:

- `disaggregated`: reserve KV blocks on a decode worker (router/reservation.py) -> prefill on a
  prefill worker, whose first token streams at once (the decode reservation renewed while the prompt
  waits) -> the decode worker's tokens. The handoff between them is theirs: the prefill worker
  admits the request on the decode worker itself (first token, and a routed transport's KV
  deliveries), and the decode worker acknowledges the KV to it; the first decoded chunk tells the
  router the KV is installed (the prefill worker holds nothing of it any more, or soon: the lease
  settles a lost ack).
- `local`: the whole request on one worker: a colocated worker, or a disaggregated system's decode
  worker prefilling it itself (router/pd_policy.py).

Worker calls go through `WorkerClient` (typed, transport hidden); the attempt's workers are tracked
in its `Route` (router/registry.py), which the router settles when the attempt ends.
"""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Optional

from protocol.requests import AdmitColocatedRequest, PrefillRequest, RenewRequest
from router import kv_wire
from router.chunks import read_chunks
from router.counting import Count, QueuedPrompt
from router.failures import RequestAborted
from router.kv_index import PrefixIndex
from router.links import kv_bytes_shipped
from router.metrics import RouterMetrics
from router.output import Output, Progress, StreamItem
from router.placement import Placement, Prompt
from router.pools.workers import NoWorkerError
from router.registry import Registry, RequestRecord
from router.reservation import DecodeReservation
from router.worker_client import WorkerClient


class Flows:
    """`stats` is the router's `RouterStats` (first tokens); `ttft_target_s`: the SLO's TTFT, which
    orders the prefill queue (None: first come, first served)."""

    def __init__(
        self,
        placement: Placement,
        reservation: DecodeReservation,
        registry: Registry,
        client: WorkerClient,
        output: Output,
        stats,
        metrics: RouterMetrics,
        kv_index: PrefixIndex,
        kv_timeout_s: float,
        stream_interval: int,
        ttft_target_s: Optional[float] = None,
        wire: kv_wire.KVWireConfig = kv_wire.KVWireConfig(),
    ):
        self._placement = placement
        self._reservation = reservation
        self._registry = registry
        self._client = client
        self._output = output
        self._stats = stats
        self._metrics = metrics
        self._kv_index = kv_index
        self._kv_timeout_s = kv_timeout_s
        self._stream_interval = stream_interval
        # the SLO's TTFT, which prompts carry into the prefill queue; None: no deadlines (fcfs)
        self._ttft_target_s = ttft_target_s
        self._wire = wire

    async def disaggregated(
        self, record: RequestRecord, wid: str, prompt: Prompt, params, progress: Progress
    ) -> AsyncIterator[StreamItem]:
        placement, client = self._placement, self._client
        with contextlib.ExitStack() as counts:
            # The prompt counts in its prefill worker's queue from now, so the next request's
            # placement sees it; no prefill worker: UNAVAILABLE at once, before reserving anything.
            prefill = placement.pick(placement.prefill_pool, prompt)
            deadline_s = self._deadline_s(progress)
            queued = counts.enter_context(QueuedPrompt(prefill, len(prompt.ids), deadline_s))
            decode, reused_blocks = await self._reservation.reserve(record, wid, prompt)
            if not prefill.is_ready:  # it began draining or died while we reserved: another one
                queued.release()
                try:
                    prefill = placement.pick(placement.prefill_pool, prompt)
                except NoWorkerError:
                    client.abort(decode, wid)  # frees the reservation now, not at its timeout
                    raise
                counts.enter_context(QueuedPrompt(prefill, len(prompt.ids), deadline_s))
            route = self._registry.track(record, wid, prefill, decode)
            # The reservation's clock is renewed while the prompt waits in the prefill queue: a long
            # queue must never expire it (its timeout is for KV that stopped coming, not for KV not
            # yet computed). The prefill worker skips the blocks the decode worker reused, and hands
            # the request to the decode worker itself.
            renewal = RenewRequest(wid, self._kv_timeout_s)
            wire = self._wire_choice(prompt, prefill, decode, reused_blocks)
            with route.prefill_count:
                result = await client.prefill(
                    prefill,
                    record,
                    PrefillRequest(
                        wid,
                        prompt.ids,
                        params,
                        decode.info.kv_address,
                        reused_blocks,
                        decode=decode.actor,
                        ttft_budget_s=None if deadline_s is None else deadline_s - time.monotonic(),
                        kv_wire=wire.mode,
                    ),
                    every_s=self._kv_timeout_s / 3,
                    tick=lambda: client.renew(decode, renewal),
                )
        if result is None:  # the prefill worker was told to abort it
            raise RequestAborted()
        self._kv_index.apply(prefill.worker_id, result.kv_events)
        prefill.costs = result.costs
        self._count_reuse(prefill.info.role, result.num_cached_prompt_tokens)
        self._count_reuse(
            decode.info.role,
            reused_blocks * decode.info.block_size_tokens,
            reused_blocks * decode.info.kv_block_bytes,
        )
        progress.prefill = result
        progress.cached_prompt_tokens = result.num_cached_prompt_tokens
        if result.kv_bytes:
            progress.kv_wire = f"{result.kv_wire} ({wire.reason})"
            self._metrics.kv_wire.labels(result.kv_wire, wire.reason).inc()
            self._metrics.kv_wire_bytes.labels("raw").inc(result.kv_bytes)
            self._metrics.kv_wire_bytes.labels("wire").inc(result.kv_wire_bytes)
        if progress.first_token_s is None:
            now = time.monotonic()
            self._stats.first_token(now, now - progress.start_s, result.queue_s)
        first_logprobs = (
            None if result.first_token_logprobs is None else (result.first_token_logprobs,)
        )
        first = (result.first_token_id,)
        if result.finish_reason is not None:  # finished at its first token: nothing to hand off
            route.prefill_released = True
            yield self._output.item(
                progress,
                first,
                result.finish_reason,
                decode.worker_id,
                first_logprobs,
                result.prompt_logprobs,
            )
            return
        yield self._output.item(
            progress, first, None, decode.worker_id, first_logprobs, result.prompt_logprobs
        )
        async for chunk in read_chunks(
            route, client, self._stream_interval, coalesce=not params.stop
        ):
            if chunk.kv_ready_wall_s is not None:  # acknowledged to the prefill worker already
                progress.kv_transfer_s = max(0.0, chunk.kv_ready_wall_s - result.kv_sent_wall_s)
                route.prefill_released = True
                # the link learns from the wire: the bytes sent, in the time left once the codec's
                # predicted cost is taken off
                codec_s = kv_wire.codec_s(result.kv_wire, decode.info.dtype, result.kv_bytes)
                placement.links.observe(
                    prefill.info.node,
                    decode.info.node,
                    result.kv_wire_bytes or result.kv_bytes,
                    max(0.0, progress.kv_transfer_s - codec_s),
                )
            progress.decode_step_s = chunk.decode_step_s
            yield self._output.item(
                progress, chunk.token_ids, chunk.finish_reason, decode.worker_id, chunk.logprobs
            )

    def _wire_choice(
        self, prompt: Prompt, prefill, decode, reused_blocks: int
    ) -> kv_wire.WireChoice:
        """How this attempt's KV goes on the wire: the blocks it ships, over the link it crosses."""
        kv_bytes = kv_bytes_shipped(len(prompt.ids), reused_blocks, decode.info)
        link = self._placement.links.estimate(prefill.info.node, decode.info.node)
        return kv_wire.choose(self._wire, kv_bytes, decode.info.dtype, link)

    def _deadline_s(self, progress: Progress) -> Optional[float]:
        """When the SLO's TTFT for a prompt going to the prefill queue runs out (time.monotonic()):
        what is left of it is sent as its deadline there. None without a target, or when its first
        token went out already (a migration's re-prefill, which the prefill worker then takes in its
        arrival order, ahead of the prompts with deadlines after it)."""
        if self._ttft_target_s is None or progress.first_token_s is not None:
            return None
        return progress.start_s + self._ttft_target_s

    async def local(
        self, record: RequestRecord, wid: str, prompt: Prompt, params, progress: Progress
    ) -> AsyncIterator[StreamItem]:
        worker = self._placement.pick(self._placement.decode_pool, prompt)
        route = self._registry.track(record, wid, None, worker)
        # until its first token: the worker's local prefill queue
        with Count(worker, "queued_prompt_tokens", len(prompt.ids)) as queued:
            await self._client.admit_colocated(
                worker, record, AdmitColocatedRequest(wid, prompt.ids, params)
            )
            first = True
            async for chunk in read_chunks(
                route, self._client, self._stream_interval, coalesce=not params.stop
            ):
                if first:
                    self._count_reuse(worker.info.role, chunk.num_cached_prompt_tokens)
                    first = False
                queued.release()
                progress.cached_prompt_tokens = max(
                    progress.cached_prompt_tokens, chunk.num_cached_prompt_tokens
                )
                progress.decode_step_s = chunk.decode_step_s
                yield self._output.item(
                    progress,
                    chunk.token_ids,
                    chunk.finish_reason,
                    worker.worker_id,
                    chunk.logprobs,
                    chunk.prompt_logprobs,
                )

    def _count_reuse(self, role: str, cached_tokens: int, bytes_not_shipped: int = 0) -> None:
        if cached_tokens:
            self._metrics.prefix_hit_tokens.labels(role).inc(cached_tokens)
        if bytes_not_shipped:
            self._metrics.kv_bytes_reused.inc(bytes_not_shipped)
