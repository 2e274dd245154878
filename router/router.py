"""The request flow on the router: admit, place, prefill, hand the KV over, stream, finish, abort or
migrate. (Its failures: router/failures.py; the tokens coming back: router/token_stream.py; what the
client is sent: router/output.py; where it prefills: router/pd_policy.py.)

Disaggregated: reserve KV blocks on a decode worker first (so a transfer never lands where there is no
room) -> prefill on a prefill worker, whose first token streams to the client at once -> route the
KV delivery (ray transport) -> stream the decode worker's tokens. Colocated: one worker does both.
If the client goes away, the request is aborted on every worker that holds it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from protocol.messages import PrefillResult
from protocol.requests import (
    AbortRequest,
    AcknowledgeRequest,
    AdmitColocatedRequest,
    AdmitRequest,
    PrefillRequest,
    RenewRequest,
    ReserveRequest,
)
from protocol.token_stream import TokenChunk
from router.failures import (
    AdmissionTimeoutError,
    DuplicateRequestError,
    RequestAborted,
    WorkerError,
    WorkerLost,
    is_actor_death,
)
from router.kv_index import Candidate, PrefixIndex, RoutingConfig, prompt_hashes, rank
from router.metrics import RouterMetrics
from router.output import FinalInfo, Progress, StreamItem, typed_logprobs
from router.overload import AdmissionLimits, OverloadedError
from router.pd_policy import Decision, PDPolicyConfig, decide
from router.pool import NoWorkerError, WorkerHandle, WorkerPool
from router.slo import COUNTED_FINISH_REASONS, FAST_SLO, SLO
from router.token_stream import TokenStreams, joined, open_chunk
from router.validation import ValidatedRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    mode: str  # "disaggregated" or "colocated"
    # How long a decode worker keeps a reservation (renewed while the prompt waits for prefill) and
    # received KV that nobody claims: the KV handoff's one timeout (the prefill side's lease too).
    kv_timeout_s: float = 30.0
    max_migrations: int = 3  # re-runs of one request after workers died under it, before it fails
    # how long a request may wait for KV room before RESOURCE_EXHAUSTED
    admission_timeout_s: float = 120.0
    limits: AdmissionLimits = AdmissionLimits()
    # Decode tokens a request's message waits for (SGLang's --stream-interval): 1 sends each step's token
    # at once; N sends every N-th step, N times fewer messages for the router, less smooth for the client.
    stream_interval: int = 1
    # where a disaggregated request is prefilled (router/pd_policy.py)
    pd: PDPolicyConfig = PDPolicyConfig()
    routing: RoutingConfig = RoutingConfig()  # which worker of a pool (router/kv_index.py)
    slo: SLO = SLO.parse(FAST_SLO)  # what completed requests are judged against (router/slo.py)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")


@dataclass
class _Route:
    """Which workers hold a request (one attempt of it), and which of them are done with it."""

    # the id the workers know this attempt by (the request id, then id~1, id~2...)
    worker_request_id: str
    prefill: Optional[WorkerHandle]
    decode: WorkerHandle
    # first token back and the KV acknowledged (or nothing to hand off)
    prefill_released: bool = False
    decode_finished: bool = False


@dataclass(frozen=True)
class _Prompt:
    """One attempt's prompt as placement sees it: token ids, and their block hashes (prefix routing)."""

    ids: list[int]
    hashes: list[bytes]


@dataclass
class _Request:
    """A client request from admission to its end; its id stays claimed all that time."""

    request_id: str
    aborted: asyncio.Future  # done once `Router.abort` was called for it
    route: Optional[_Route] = None  # the current attempt, once its workers are chosen


@dataclass
class Router:
    config: RouterConfig
    tokenizer: Tokenizer
    prefill_pool: WorkerPool
    decode_pool: WorkerPool  # in colocated mode: the colocated workers
    requests_completed: int = 0
    requests_failed: int = 0
    # claimed at admission, until the request ends
    in_flight: dict[str, _Request] = field(default_factory=dict)
    kv_index: PrefixIndex = field(default_factory=PrefixIndex)  # which worker holds which prefix
    # the decode workers' tokens, per request (built with kv_index)
    streams: Optional[TokenStreams] = None
    migrations: int = 0
    # completed requests judged against config.slo (router/slo.py), since start
    slo_finished: int = 0
    slo_met: int = 0  # of those, the ones that met both targets
    # (monotonic time, TTFT s, queue s) of recent first tokens, and requests waiting for KV room:
    # the autoscaler's signals.
    recent_first_tokens: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=512)
    )
    # (time, TPOT s)
    recent_tpots: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))
    waiting_for_kv: int = 0
    # requests inside `generate` (queued or running): bounded by limits.max_in_flight
    active: int = 0
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    _background: set = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = TokenStreams(self.kv_index)
        self.metrics.set_slo(self.config.slo)

    def recent_p50(
        self, samples: collections.deque, now_s: float, window_s: float = 30.0
    ) -> Optional[float]:
        """Median of the second field of recent (time, value, ...) samples, or None."""
        values = sorted(sample[1] for sample in samples if now_s - sample[0] <= window_s)
        return values[len(values) // 2] if values else None

    async def generate(self, request: ValidatedRequest) -> AsyncIterator[StreamItem]:
        """Streams a request's output; the last item carries `final` (finish reason "abort" after
        `abort`). Raises at once DuplicateRequestError when its id is in flight and OverloadedError when
        the router's queues are full, and the errors of the flow (WorkerError, ...) as they come."""
        if request.request_id in self.in_flight:
            self.metrics.requests.labels("invalid").inc()
            raise DuplicateRequestError(f"request_id: {request.request_id!r} is already in flight")
        if self.active >= self.config.limits.max_in_flight:
            self.metrics.requests.labels("rejected").inc()
            raise OverloadedError(
                f"the server holds {self.active} requests, its limit (--max-in-flight); retry later"
            )
        record = self.in_flight[request.request_id] = _Request(
            request.request_id, asyncio.get_running_loop().create_future()
        )
        stop_ids = frozenset(request.params.stop_token_ids) | (
            frozenset()
            if request.params.ignore_eos
            else frozenset(self.tokenizer.special.eos_token_ids)
        )
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.params.stop)
        progress = Progress(time.monotonic(), len(request.prompt_ids), detok, stop_ids)
        log.info(
            "received: %d prompt tokens, max_tokens %d",
            len(request.prompt_ids),
            request.params.max_tokens,
        )
        final: Optional[FinalInfo] = None
        # unless it finishes or fails: the client went away, or `abort` was called
        outcome = "aborted"
        self.active += 1
        try:
            try:
                async for item in self._migrating(record, request, progress):
                    final = item.final
                    if final is not None:
                        # before the client sees the end, so /metrics already counts it
                        self._finished(final)
                    yield item
                    if final is not None:
                        break
            except RequestAborted:
                log.info("aborted")
                yield StreamItem(
                    [], detok.flush(), self._final(progress, "abort", time.monotonic(), None)
                )
        except (AdmissionTimeoutError, OverloadedError):
            outcome = "rejected"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self.active -= 1
            self._settle(record)
            del self.in_flight[request.request_id]
            if final is None:
                self.requests_failed += 1
                self.metrics.requests.labels(outcome).inc()
                log.info("ended without finishing: %s", outcome)

    def _finished(self, final: FinalInfo) -> None:
        self.requests_completed += 1
        self.metrics.observe_finished(final)
        if final.finish_reason in COUNTED_FINISH_REASONS:
            result = self.config.slo.result(
                final.ttft_s, final.tpot_s if final.completion_tokens > 1 else None
            )
            self.slo_finished += 1
            self.slo_met += result == "met"
            self.metrics.observe_slo(result)
        log.info(
            "finished (%s): %d prompt (%d cached) + %d completion tokens, TTFT %.1f ms (queue %.1f, prefill "
            "%.1f), TPOT %.1f ms, KV %d B in %.1f ms, prefill %s, decode %s",
            final.finish_reason,
            final.prompt_tokens,
            final.cached_prompt_tokens,
            final.completion_tokens,
            final.ttft_s * 1e3,
            final.queue_s * 1e3,
            final.prefill_s * 1e3,
            final.tpot_s * 1e3,
            final.kv_bytes,
            final.kv_transfer_s * 1e3,
            final.prefill_worker or "-",
            final.decode_worker,
        )

    def _settle(self, record: _Request) -> None:
        """Forgets a request's current attempt: counters down, and an abort wherever it may still hold blocks."""
        route, record.route = record.route, None
        if route is None:
            return
        self.streams.close(route.worker_request_id)
        wid = route.worker_request_id
        if route.prefill is not None:
            if not route.prefill_released and route.prefill.state != "dead":
                self._fire(route.prefill.actor.abort.remote(AbortRequest(wid)))
        route.decode.in_flight -= 1
        if not route.decode_finished and route.decode.state != "dead":
            self._fire(route.decode.actor.abort.remote(AbortRequest(wid)))

    async def abort(self, request_id: str) -> bool:
        """Ends a request in flight at once (its stream's last item has finish reason "abort"); its
        workers are aborted as it ends. False when no such request is in flight."""
        record = self.in_flight.get(request_id)
        if record is None:
            return False
        if not record.aborted.done():
            record.aborted.set_result(None)
        if record.route is not None:  # a consumer waiting for tokens wakes up
            inbox = self.streams.inbox(record.route.worker_request_id)
            if inbox is not None:
                inbox.put_nowait(RequestAborted())
        return True

    # -- the two flows, and migration ------------------------------------------------------------

    async def _migrating(
        self, record: _Request, request: ValidatedRequest, progress: Progress
    ) -> AsyncIterator[StreamItem]:
        """Runs the mode's flow; when a worker dies under the request, re-runs prompt + tokens so far on
        healthy workers (the client sees only latency; greedy and seeded output stay the same)."""
        attempt = 0
        while True:
            wid = request.request_id if attempt == 0 else f"{request.request_id}~{attempt}"
            prompt = self._prompt(request.prompt_ids + progress.token_ids)
            # Logprobs of the tokens already streamed are not asked again: a re-prefill's prompt logprobs
            # only if none went out yet, and its first token's are the next token's.
            params = dataclasses.replace(
                request.params,
                max_tokens=request.params.max_tokens - len(progress.token_ids),
                prompt_logprobs=None if progress.token_ids else request.params.prompt_logprobs,
            )
            flow = self._colocated
            if self.config.mode == "disaggregated" and self._place(prompt).path == "remote":
                flow = self._disaggregated
            try:
                async for item in flow(record, wid, prompt, params, progress):
                    yield item
                return
            except WorkerLost as lost:
                lost.worker.state = "dead"
                self._settle(record)
                attempt += 1
                if attempt > self.config.max_migrations:
                    raise WorkerError(f"{lost}; gave up after {attempt} attempts") from lost
                self.migrations += 1
                self.metrics.migrations.inc()
                log.warning(
                    "%s; migrating with %d tokens so far (attempt %d)",
                    lost,
                    len(progress.token_ids),
                    attempt + 1,
                )

    def _prompt(self, prompt_ids: list[int]) -> _Prompt:
        workers = self.decode_pool.ready() or self.prefill_pool.ready()
        hashes = (
            prompt_hashes(self.config.routing, prompt_ids, workers[0].info.block_size_tokens)
            if workers
            else []
        )
        return _Prompt(prompt_ids, hashes)

    def _ranked(self, pool: WorkerPool, prompt: _Prompt) -> list[Candidate]:
        return rank(
            self.config.routing,
            self.kv_index,
            pool.ready(),
            prompt.hashes,
            len(prompt.ids),
            pool.role,
        )

    def _place(self, prompt: _Prompt) -> Decision:
        """Where a disaggregated request's prompt is prefilled: the prefill pool, or its decode worker
        (each pool's best candidate compared: queued prompt tokens, and what each holds of the prompt)."""
        remote = next(iter(self._ranked(self.prefill_pool, prompt)), None)
        local = next(iter(self._ranked(self.decode_pool, prompt)), None)
        decision = decide(
            self.config.pd,
            len(prompt.ids),
            remote and remote.worker.queued_prompt_tokens,
            local.worker.queued_prompt_tokens if local else 0,
            remote.cached_tokens if remote else 0,
            local.cached_tokens if local else 0,
        )
        self.metrics.pd_decisions.labels(decision.path, decision.reason).inc()
        return decision

    def _pick(self, pool: WorkerPool, prompt: _Prompt) -> WorkerHandle:
        """The pool's best worker for this prompt (router/kv_index.py); NoWorkerError when none is ready."""
        ranked = self._ranked(pool, prompt)
        if not ranked:
            raise NoWorkerError(f"no ready {pool.role} worker")
        self._count_routing(pool.role, ranked[0])
        return ranked[0].worker

    def _count_routing(self, role: str, chosen: Candidate) -> None:
        reason = (
            "load"
            if self.config.routing.policy == "load"
            else "prefix_hit"
            if chosen.cached_tokens
            else "no_hit"
        )
        self.metrics.routing_decisions.labels(role, reason).inc()

    async def _disaggregated(
        self, record: _Request, wid: str, prompt: _Prompt, params, progress: Progress
    ) -> AsyncIterator[StreamItem]:
        # The prompt counts in its prefill worker's queue from now, so the next request's placement
        # (`_place`) sees it; no prefill worker: UNAVAILABLE at once, before reserving anything.
        prompt_ids = prompt.ids
        queued = len(prompt_ids)
        prefill = self._pick(self.prefill_pool, prompt)
        prefill.queued_prompt_tokens += queued
        try:
            decode, reused_blocks = await self._reserve_decode(record, wid, prompt)
            if prefill.state != "ready":  # it began draining or died while we reserved: another one
                prefill.queued_prompt_tokens -= queued
                queued = 0
                try:
                    prefill = self._pick(self.prefill_pool, prompt)
                except NoWorkerError:
                    # frees the reservation now, not at its timeout
                    self._fire(decode.actor.abort.remote(AbortRequest(wid)))
                    raise
                queued = len(prompt_ids)
                prefill.queued_prompt_tokens += queued
            route = self._track(record, wid, prefill, decode)
            # The reservation's clock is renewed while the prompt waits in the prefill queue: a long queue
            # must never expire it (its timeout is for KV that stopped coming, not for KV not yet computed).
            timeout_s = self.config.kv_timeout_s
            try:
                # The prefill worker skips the blocks the decode worker already holds (`reused_blocks`).
                result: Optional[PrefillResult] = await self._call(
                    prefill,
                    prefill.actor.prefill.remote(
                        PrefillRequest(
                            wid, prompt_ids, params, decode.info.kv_address, reused_blocks
                        )
                    ),
                    record,
                    every_s=timeout_s / 3,
                    tick=lambda: self._fire(
                        decode.actor.renew.remote(RenewRequest(wid, timeout_s))
                    ),
                )
            finally:
                prefill.in_flight -= 1
        finally:
            prefill.queued_prompt_tokens -= queued
        if result is None:  # the prefill worker was told to abort it
            raise RequestAborted()
        self.kv_index.apply(prefill.worker_id, result.kv_events)
        self._count_reuse(prefill.info.role, result.num_cached_prompt_tokens)
        self._count_reuse(
            decode.info.role,
            reused_blocks * decode.info.block_size_tokens,
            reused_blocks * decode.info.kv_block_bytes,
        )
        progress.prefill = result
        progress.cached_prompt_tokens = result.num_cached_prompt_tokens
        if progress.first_token_s is None:
            now = time.monotonic()
            self.recent_first_tokens.append((now, now - progress.start_s, result.queue_s))
        first_logprobs = (
            None if result.first_token_logprobs is None else (result.first_token_logprobs,)
        )
        # finished at its first token: nothing to hand off or decode
        if result.finish_reason is not None:
            route.prefill_released = True
            yield self._item(
                progress,
                (result.first_token_id,),
                result.finish_reason,
                decode,
                first_logprobs,
                result.prompt_logprobs,
            )
            return
        yield self._item(
            progress, (result.first_token_id,), None, decode, first_logprobs, result.prompt_logprobs
        )
        await self._call(
            decode,
            decode.actor.admit.remote(
                AdmitRequest(wid, prompt_ids, result.first_token_id, params, result.deliveries)
            ),
            record,
        )
        async for chunk in self._chunks(route, coalesce=not params.stop):
            if chunk.kv_ready_wall_s is not None:
                progress.kv_transfer_s = max(0.0, chunk.kv_ready_wall_s - result.kv_sent_wall_s)
                route.prefill_released = True
                # a routed transport's acknowledgement travels the same way (grpc's is in-band)
                if result.deliveries:
                    self._fire(prefill.actor.acknowledge.remote(AcknowledgeRequest(wid)))
            yield self._item(progress, chunk.token_ids, chunk.finish_reason, decode, chunk.logprobs)

    def _count_reuse(self, role: str, cached_tokens: int, bytes_not_shipped: int = 0) -> None:
        if cached_tokens:
            self.metrics.prefix_hit_tokens.labels(role).inc(cached_tokens)
        if bytes_not_shipped:
            self.metrics.kv_bytes_reused.inc(bytes_not_shipped)

    async def _reserve_decode(
        self, record: _Request, wid: str, prompt: _Prompt
    ) -> tuple[WorkerHandle, int]:
        """Reserves KV blocks for the prompt on a decode worker, trying each (best first) and then waiting
        while all are full, so a transfer never lands where there is no room and a busy pool queues.
        Returns the worker and how many leading blocks of the prompt it already held (reused, not sent;
        prefix routing only: under load routing the whole prompt is sent, as before it)."""
        num_prompt_tokens = len(prompt.ids)
        prompt_ids = prompt.ids if self.config.routing.policy == "prefix" else None
        deadline = time.monotonic() + self.config.admission_timeout_s
        delay_s = 0.005
        # counted in `waiting_for_kv` (an autoscaler signal) once a full round failed
        waiting = False
        try:
            while True:
                if not self.decode_pool.ready():
                    raise NoWorkerError(f"no healthy {self.decode_pool.role} worker")
                for candidate in self._ranked(self.decode_pool, prompt):
                    decode = candidate.worker
                    if decode.state != "ready":  # it stopped being ready while we tried another
                        continue
                    decode.reserving += 1  # a drain waits for it
                    try:
                        reused = await self._unless_aborted(
                            record,
                            decode.actor.reserve.remote(
                                ReserveRequest(
                                    wid, num_prompt_tokens, self.config.kv_timeout_s, prompt_ids
                                )
                            ),
                        )
                        if reused is None:  # no room there now
                            continue
                        if decode.state == "ready":
                            self._count_routing(decode.info.role, candidate)
                            return decode, reused
                        # A scale-down began draining it while we reserved: hand the blocks back before
                        # the drain looks (it waits for `reserving`), and go elsewhere.
                        await decode.actor.abort.remote(AbortRequest(wid))
                    except (asyncio.CancelledError, RequestAborted):
                        # The client left (or aborted) while the reservation was on its way: it may be
                        # made by now, and nothing else knows of it.
                        self._fire(decode.actor.abort.remote(AbortRequest(wid)))
                        raise
                    except Exception as error:
                        if not is_actor_death(error):
                            raise
                        decode.state = "dead"  # skipped from now on; the pool manager replaces it
                    finally:
                        decode.reserving -= 1
                if time.monotonic() + delay_s > deadline:
                    raise AdmissionTimeoutError(
                        f"no decode worker had KV room for {num_prompt_tokens} prompt tokens within "
                        f"{self.config.admission_timeout_s:.0f} s"
                    )
                if not waiting:
                    if self.waiting_for_kv >= self.config.limits.max_waiting_for_kv:
                        raise OverloadedError(
                            f"{self.waiting_for_kv} requests already wait for KV room, the limit "
                            "(--max-waiting); retry later"
                        )
                    waiting = True
                    self.waiting_for_kv += 1
                await self._unless_aborted(record, asyncio.sleep(delay_s))
                delay_s = min(delay_s * 2, 0.1)
        finally:
            if waiting:
                self.waiting_for_kv -= 1

    async def _colocated(
        self, record: _Request, wid: str, prompt: _Prompt, params, progress: Progress
    ) -> AsyncIterator[StreamItem]:
        """The whole request on one worker: a colocated worker, or a disaggregated system's decode worker
        prefilling it locally (router/pd_policy.py)."""
        prompt_ids = prompt.ids
        worker = self._pick(self.decode_pool, prompt)
        route = self._track(record, wid, None, worker)
        queued = len(prompt_ids)  # until its first token: the worker's local prefill queue
        worker.queued_prompt_tokens += queued
        try:
            await self._call(
                worker,
                worker.actor.admit_colocated.remote(AdmitColocatedRequest(wid, prompt_ids, params)),
                record,
            )
            async for chunk in self._chunks(route, coalesce=not params.stop):
                if queued:  # its first chunk
                    self._count_reuse(worker.info.role, chunk.num_cached_prompt_tokens)
                worker.queued_prompt_tokens -= queued
                queued = 0
                progress.cached_prompt_tokens = max(
                    progress.cached_prompt_tokens, chunk.num_cached_prompt_tokens
                )
                yield self._item(
                    progress,
                    chunk.token_ids,
                    chunk.finish_reason,
                    worker,
                    chunk.logprobs,
                    chunk.prompt_logprobs,
                )
        finally:
            worker.queued_prompt_tokens -= queued

    # -- helpers -------------------------------------------------------------------------------

    async def _call(
        self,
        worker: WorkerHandle,
        call,
        record: _Request,
        every_s: Optional[float] = None,
        tick=None,
    ):
        """Awaits a worker call for a request; the worker's death becomes WorkerLost (the request
        migrates), the request's abort RequestAborted at once. `tick` runs every `every_s` meanwhile."""
        try:
            result = await self._unless_aborted(record, call, every_s, tick)
        except Exception as error:
            if is_actor_death(error):
                raise WorkerLost(worker, type(error).__name__) from error
            raise
        worker.last_heard_s = time.monotonic()
        return result

    async def _unless_aborted(
        self, record: _Request, awaitable, every_s: Optional[float] = None, tick=None
    ):
        """`awaitable`'s result, or RequestAborted as soon as the request is aborted (the awaitable is
        then cancelled, as it is when the caller is)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                if record.aborted.done():
                    raise RequestAborted()
                await asyncio.wait(
                    (task, record.aborted), timeout=every_s, return_when=asyncio.FIRST_COMPLETED
                )
                if task.done():
                    return task.result()
                if tick is not None and not record.aborted.done():
                    tick()
        finally:
            if not task.done():
                task.cancel()

    async def _chunks(self, route: _Route, coalesce: bool = True) -> AsyncIterator[TokenChunk]:
        """A request's chunks as its decode worker sent them; with `coalesce`, chunks that queued up while
        this stream was behind (a busy router) leave as one, so a backlog costs one message, not one per
        step, and a chunk waits until it holds `stream_interval` tokens (or ends the request). Requests with
        stop strings are not coalesced: the router may end them on a token in the middle of a chunk."""
        stream = self.streams.inbox(route.worker_request_id)
        # The first chunk is never held back: it is the first token (colocated), or the one that tells the
        # router the KV arrived (disaggregated), which frees the prefill worker's blocks.
        wanted = 1
        pending = None
        while True:
            chunk, pending = (pending if pending is not None else await stream.get()), None
            while (
                coalesce
                and open_chunk(chunk)
                and (len(chunk.token_ids) < wanted or not stream.empty())
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
                    and not await self._alive(route.prefill)
                ):
                    raise WorkerLost(route.prefill, f"its KV handoff failed ({chunk.error})")
                raise WorkerError(chunk.error)
            if chunk.finish_reason is not None:
                route.decode_finished = True
            yield chunk
            if chunk.finish_reason is not None:
                return
            wanted = self.config.stream_interval

    async def _alive(self, worker: WorkerHandle, timeout_s: float = 5.0) -> bool:
        try:
            await asyncio.wait_for(worker.actor.load.remote(), timeout_s)
            return True
        except Exception as error:
            return not is_actor_death(error)

    def _item(
        self,
        progress: Progress,
        token_ids,
        finish_reason: Optional[str],
        decode: WorkerHandle,
        logprobs=None,
        prompt_logprobs=None,
    ) -> StreamItem:
        now = time.monotonic()
        if progress.first_token_s is None and token_ids:
            progress.first_token_s = now
        if token_ids:
            if progress.last_item_s is not None:
                self.metrics.itl.observe(now - progress.last_item_s)
            progress.last_item_s = now
            self.metrics.generation_tokens.inc(len(token_ids))
        progress.completion_tokens += len(token_ids)
        progress.token_ids.extend(token_ids)
        item = StreamItem(
            list(token_ids),
            progress.text_for(token_ids, finish_reason),
            logprobs=typed_logprobs(logprobs),
            prompt_logprobs=typed_logprobs(prompt_logprobs),
        )
        if progress.detok.stop_string is not None and finish_reason is None:
            # the router saw the stop string first; the worker is aborted in `generate`
            finish_reason = "stop"
        if finish_reason is not None:
            item.final = self._final(progress, finish_reason, now, decode)
        return item

    def _final(
        self, progress: Progress, finish_reason: str, now: float, decode: Optional[WorkerHandle]
    ) -> FinalInfo:
        first = progress.first_token_s or now
        ttft_s = first - progress.start_s
        tokens = progress.completion_tokens
        if tokens > 1:
            self.recent_tpots.append((now, (now - first) / (tokens - 1)))
        if progress.prefill is None:  # colocated: the first token came from the one worker
            self.recent_first_tokens.append((now, ttft_s, 0.0))
        prefill = progress.prefill
        return FinalInfo(
            finish_reason=finish_reason,
            prompt_tokens=progress.prompt_tokens,
            completion_tokens=tokens,
            cached_prompt_tokens=progress.cached_prompt_tokens,
            ttft_s=ttft_s,
            tpot_s=(now - first) / (tokens - 1) if tokens > 1 else 0.0,
            queue_s=prefill.queue_s if prefill else 0.0,
            prefill_s=prefill.prefill_s if prefill else 0.0,
            kv_bytes=prefill.kv_bytes if prefill else 0,
            kv_transfer_s=progress.kv_transfer_s,
            e2e_s=now - progress.start_s,
            prefill_worker=prefill.worker_id if prefill else "",
            decode_worker=decode.worker_id if decode is not None else "",
        )

    def _track(
        self, record: _Request, wid: str, prefill: Optional[WorkerHandle], decode: WorkerHandle
    ) -> _Route:
        for worker in (prefill, decode):
            if worker is not None:
                worker.in_flight += 1
        route = record.route = _Route(wid, prefill, decode, prefill_released=prefill is None)
        self.streams.open(wid, decode)  # before any call that could make the worker emit
        return route

    def _fire(self, awaitable) -> None:
        """Runs a best-effort worker call in the background, logging (not raising) its failure."""

        async def run():
            try:
                await awaitable
            except Exception as error:
                log.warning("background worker call failed: %s", error)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
