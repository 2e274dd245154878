"""The router: a request's life from admission to its end, composed of small parts, the way
mini-sglang's scheduler composes its managers:

- `registry.Registry`: the requests in flight (one record each, its id claimed until it ends), each
  attempt's `Route` (which workers hold it), abort;
- `placement.Placement`: which worker of a pool, and where a disaggregated attempt prefills
  (`kv_index.rank`, `pd_policy.decide`);
- `reservation.DecodeReservation`: KV room on a decode worker before a prefill, with backoff;
- `flows.Flows`: the disaggregated and the local flow, over `worker_client.WorkerClient` (one typed
  method per Ray call; the transport's differences hidden) and `chunks.read_chunks` (coalescing);
- `output.Output`: the items a client is sent; `stats.RouterStats`: the counts, the autoscaler's
  signals and the Prometheus metrics they feed; `token_stream.TokenStreams`: the decode workers'
  token streams.

`Router` itself admits a request, runs the mode's flow and migrates the request when a worker dies
under it. Servers, pools and the system use only its public methods and properties.
(Its failures: router/failures.py.)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from router.failures import (
    AdmissionTimeoutError,
    DuplicateRequestError,
    RequestAborted,
    WorkerError,
    WorkerLost,
)
from router.flows import Flows
from router.kv_index import PrefixIndex, RoutingConfig
from router.kv_wire import KVWireConfig
from router.links import LinkEstimate, LinkKey, Links
from router.metrics import RouterMetrics, Snapshot
from router.output import FinalInfo, Output, Progress, StreamItem
from router.overload import AdmissionLimits, OverloadedError
from router.pd_policy import PREFILL_ORDERS, PDPolicyConfig
from router.placement import Placement
from router.pools.workers import WorkerHandle, WorkerPool
from router.registry import Registry, RequestRecord, Route
from router.reservation import DecodeReservation, ReservationConfig
from router.slo import FAST_SLO, SLO
from router.stats import RouterStats, RouterStatsSnapshot
from router.token_stream import TokenStreams
from router.validation import ValidatedRequest
from router.worker_client import WorkerClient

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
    # Decode tokens a request's message waits for (SGLang's --stream-interval): 1 sends each step's
    # token at once; N sends every N-th step, N times fewer messages for the router, less smooth for
    # the client.
    stream_interval: int = 1
    # where a disaggregated request is prefilled (router/pd_policy.py)
    pd: PDPolicyConfig = PDPolicyConfig()
    routing: RoutingConfig = RoutingConfig()  # which worker of a pool (router/kv_index.py)
    slo: SLO = SLO.parse(FAST_SLO)  # what completed requests are judged against (router/slo.py)
    # The prefill pool's queue: "slo" sends each prompt with what is left of the SLO's TTFT, and the
    # prefill worker takes the prompts that can still make it first, earliest deadline first
    # (engine/scheduler.py: Scheduler.prefill_order); "fcfs": first come, first served.
    prefill_order: str = "slo"
    kv_wire: KVWireConfig = KVWireConfig()  # how KV goes on the wire (router/kv_wire.py)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, "
                f"got {self.prefill_order!r}"
            )


class Router:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        prefill_pool: WorkerPool,
        decode_pool: WorkerPool,  # in colocated mode: the colocated workers
    ):
        self.tokenizer = tokenizer
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        self._metrics = RouterMetrics()
        self._kv_index = PrefixIndex()  # which worker holds which prefix
        self._links = Links()  # what a KV handoff costs between two nodes (router/links.py)
        self._streams = TokenStreams(self._kv_index)  # fed with the hash events too
        self._client = WorkerClient()
        self._registry = Registry(self._streams, self._client)
        self._stats = RouterStats(self._metrics, config.slo)
        self._output = Output(self._stats, self._metrics)
        self.config = config

    # -- the public API --------------------------------------------------------------------------

    @property
    def config(self) -> RouterConfig:
        return self._config

    @config.setter
    def config(self, config: RouterConfig) -> None:
        """Replacing the config (tests do, between requests) recomposes the parts that read it."""
        self._config = config
        self._stats.set_slo(config.slo)
        self._placement = Placement(
            config.routing,
            config.pd,
            self._kv_index,
            self.prefill_pool,
            self.decode_pool,
            self._metrics,
            config.slo.ttft_s,
            self._links,
        )
        reservation = DecodeReservation(
            ReservationConfig(
                config.kv_timeout_s,
                config.admission_timeout_s,
                config.limits.max_waiting_for_kv,
                reuse_prefix=config.routing.policy == "prefix",
            ),
            self._placement,
            self._client,
            self._stats,
        )
        self._flows = Flows(
            self._placement,
            reservation,
            self._registry,
            self._client,
            self._output,
            self._stats,
            self._metrics,
            self._kv_index,
            config.kv_timeout_s,
            config.stream_interval,
            config.slo.ttft_s if config.prefill_order == "slo" else None,
            config.kv_wire,
        )

    async def generate(
        self, request: ValidatedRequest, pinned_to: Optional[Route] = None
    ) -> AsyncIterator[StreamItem]:
        """Streams a request's output; the last item carries `final` (finish reason "abort" after
        `abort`). `pinned_to`: another request's route, whose workers this one's first attempt goes
        to while they are ready (router/choices.py; a migration places afresh). Raises at once
        DuplicateRequestError when its id is in flight and OverloadedError when the router's queues
        are full, and the errors of the flow (WorkerError, ...) as they come."""
        if request.request_id in self._registry:
            self._stats.refused("invalid")
            raise DuplicateRequestError(f"request_id: {request.request_id!r} is already in flight")
        if len(self._registry) >= self.config.limits.max_in_flight:
            self._stats.refused("rejected")
            raise OverloadedError(
                f"the server holds {len(self._registry)} requests, its limit (--max-in-flight); "
                "retry later"
            )
        record = self._registry.claim(request.request_id)
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
        try:
            try:
                async for item in self._migrating(record, request, progress, pinned_to):
                    final = item.final
                    if final is not None:
                        # before the client sees the end, so /metrics already counts it
                        self._stats.finished(final)
                    yield item
                    if final is not None:
                        break
            except RequestAborted:
                log.info("aborted")
                yield StreamItem(
                    [], detok.flush(), self._output.final(progress, "abort", time.monotonic(), "")
                )
        except (AdmissionTimeoutError, OverloadedError):
            outcome = "rejected"
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self._registry.release(record)
            if final is None:
                self._stats.ended_unfinished(outcome)
                log.info("ended without finishing: %s", outcome)

    async def abort(self, request_id: str) -> bool:
        """Ends a request in flight at once (its stream's last item has finish reason "abort"), an n
        > 1 request's other choices with it; its workers are aborted as it ends. False when no such
        request is in flight."""
        found = self._registry.abort(request_id)
        for choice in self._registry.choices_of(request_id):
            found = self._registry.abort(choice) or found
        return found

    def route_of(self, request_id: str) -> Optional[Route]:
        """The workers holding a request's current attempt (`.prefill`, `.decode`); None when it is
        not in flight or not placed yet."""
        record = self._registry.get(request_id)
        return record.route if record is not None else None

    def stats(self) -> RouterStatsSnapshot:
        """The router's counts now: requests in flight and waiting for KV room, outcomes,
        migrations, the SLO, and the recent TTFT, queue and TPOT medians (the autoscaler's
        signals)."""
        return self._stats.snapshot(time.monotonic(), len(self._registry))

    def links(self) -> dict[LinkKey, LinkEstimate]:
        """What a KV handoff has cost on each link (sender node, receiver node) so far."""
        return self._links.snapshot()

    def count_refused(self, reason: str) -> None:
        """Counts a request a front end refused before it reached `generate` ("invalid",
        "unauthorized") in `pdserve_requests_total`."""
        self._stats.refused(reason)

    def render_metrics(self, snapshot: Optional[Snapshot] = None) -> bytes:
        """The Prometheus text of the router's metrics, with the pools as `snapshot` shows them
        (None: as the last snapshot given did)."""
        if snapshot is not None:
            self._metrics.set_snapshot(snapshot)
        return self._metrics.render()

    async def watch(self, worker: WorkerHandle) -> None:
        """Subscribes to a decode worker's token stream; returns once nothing it emits for requests
        routed to it after this can be lost (before it joins a pool)."""
        await self._streams.watch(worker)

    def unwatch(self, worker: WorkerHandle, reason: str) -> None:
        """Ends the subscription to a worker found dead, or stopped: its requests fail over at
        once."""
        self._streams.unwatch(worker, reason)

    async def writes_released(self) -> None:
        """A front end awaits this before writing a stream item: the consumers woken by one step of
        tokens all prepare their messages first, then write back to back
        (router/token_stream.py)."""
        await self._streams.writes_released()

    # -- migration -------------------------------------------------------------------------------

    async def _migrating(
        self,
        record: RequestRecord,
        request: ValidatedRequest,
        progress: Progress,
        pinned_to: Optional[Route],
    ) -> AsyncIterator[StreamItem]:
        """Runs the mode's flow; when a worker dies under the request, re-runs prompt + tokens so
        far on healthy workers (the client sees only latency; greedy and seeded output stay the
        same)."""
        attempt = 0
        pinned = (
            frozenset(w.worker_id for w in (pinned_to.prefill, pinned_to.decode) if w is not None)
            if pinned_to is not None
            else frozenset()
        )
        while True:
            wid = request.request_id if attempt == 0 else f"{request.request_id}~{attempt}"
            prompt = self._placement.prompt(
                request.prompt_ids + progress.token_ids, pinned if attempt == 0 else frozenset()
            )
            # Logprobs of the tokens already streamed are not asked again: a re-prefill's prompt
            # logprobs only if none went out yet, and its first token's are the next token's.
            params = dataclasses.replace(
                request.params,
                max_tokens=request.params.max_tokens - len(progress.token_ids),
                min_tokens=max(0, request.params.min_tokens - len(progress.token_ids)),
                prompt_logprobs=None if progress.token_ids else request.params.prompt_logprobs,
            )
            flow = self._flows.local
            if self.config.mode == "disaggregated":
                decision = self._placement.place(prompt)
                progress.pd_decision = f"{decision.path} ({decision.reason})"
                if decision.path == "remote":
                    flow = self._flows.disaggregated
            try:
                async for item in flow(record, wid, prompt, params, progress):
                    yield item
                return
            except WorkerLost as lost:
                lost.worker.mark_dead()
                self._registry.settle(record)
                attempt += 1
                if attempt > self.config.max_migrations:
                    raise WorkerError(f"{lost}; gave up after {attempt} attempts") from lost
                self._stats.migration()
                log.warning(
                    "%s; migrating with %d tokens so far (attempt %d)",
                    lost,
                    len(progress.token_ids),
                    attempt + 1,
                )
