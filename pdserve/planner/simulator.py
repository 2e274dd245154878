"""`pdserve simulate`: a discrete-event model of a pdserve system as it schedules, timed by a
profile.

What it models, and whose code decides:
- placement: the router's own `router.kv_index.rank` over `WorkerHandle`s whose counters the
  simulator keeps as the router does (queued prompt tokens, requests in flight), fed a `PrefixIndex`
  with the blocks each worker holds; the PD decision is `router.pd_policy.decide` itself, on the
  costs each simulated worker measures of its steps as a worker does (`runtime.costs.CostMeter`)
  and its streams' slack;
- a prefill worker: prompts in the order its scheduler takes them (`engine.deadlines` by the SLO's
  TTFT under `SystemShape.prefill_order` "slo", FIFO under "fcfs"), batched under the engine's
  token budget (only up to `SystemShape.cpu_prefill_batch_tokens` in all where the shape sets it),
  chunked beyond it; a step costs the sum of its sequences' chunks (`Profile.chunk_s`); the first
  token at the step's end; then the KV handoff (`Profile.handoff_s` of the blocks the decode worker
  lacks) before decoding starts;
- a decode or colocated worker: continuous batching as `engine.scheduler.Scheduler.schedule` does it
  (prefill chunks of `decode_interleave_tokens` alternating with decode steps while streams run, the
  whole budget when none do); a decode step costs `Profile.decode_step_s(batch, mean context)`;
- cores (runtime/cores.py, as `sim_cores.CoreModel` models them): home cores on the nodes, steps on
  borrowed cores (idle workers' and, within their streams' TPOT slack, decoding workers'), and the
  node's cores divided among its busy steps (processor sharing);
- the serving path (`Profile.serving`, fitted on a running system): engine steps as the servers ran
  them in the probe (`prefill_share`, `decode_share` beyond the profile's), a fixed cost per
  request before placement (the router, Ray calls, the first token's way back), per decode step a
  fixed cost plus one per token streamed (the stream item, the router's and client's work on the
  same cores), and a fixed cost for a step run on borrowed cores (taking them, torch's thread count
  changed and back);
- conversations: a later turn is sent its think time after the reply before it ends.
- KV capacity (`Profile.kv_capacity_tokens` per decode worker): a request's prompt and output blocks
  are reserved on its decode worker at placement; without room the router holds it, first come first
  served, until a request ends.
Not modelled: preemption (the reservation makes it unnecessary), the variance of real steps (the
profile is medians).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

from engine.deadlines import Queued, deadline_order
from pdserve.planner.profile import Profile
from pdserve.planner.report import Report, summarize
from pdserve.planner.shape import SystemShape
from pdserve.planner.sim_cores import CoreModel
from pdserve.planner.workload import Request
from protocol.messages import WorkerCosts
from router.kv_index import PrefixIndex, rank
from router.pd_policy import Side, decide
from router.pools import WorkerHandle
from router.slo import SLO
from runtime.cores import CorePolicy
from runtime.costs import CostMeter

BLOCK_SIZE_TOKENS = 16


@dataclass(eq=False)
class _Stream:
    request: Request
    hashes: list[bytes]
    arrival_s: float = 0.0  # the request's; a later turn's is known once the reply before it ends
    kv_reserved_tokens: int = 0
    follower: Optional["_Stream"] = None  # the chat's next turn
    computed_tokens: int = 0  # prompt tokens in the KV of the worker prefilling it
    # when it joined a decode batch (the engine loop's clock for slack)
    decode_started_s: float = 0.0
    queue_s: Optional[float] = None  # arrival to the start of its prefill
    token_times_s: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.token_times_s) >= self.request.output_tokens

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_tokens + len(self.token_times_s)


@dataclass(eq=False)
class _Step:
    is_prefill: bool
    chunks: list
    started_s: float
    work_s: float  # left of it, in seconds on its own cores with nobody else busy
    rate: float = 1.0  # of its own speed it runs at now (shared cores)
    rated_s: float = 0.0  # since when
    version: int = 0  # its end event's: a rescheduled end makes the earlier one stale


@dataclass(eq=False)
class _Worker:
    handle: WorkerHandle
    role: str  # "prefill", "decode" or "colocated"
    node: int
    home: tuple[int, ...]
    home_shared: bool = False
    waiting: deque = field(default_factory=deque)  # streams to prefill here
    running: list = field(default_factory=list)  # streams decoding here
    step: Optional[_Step] = None
    paused_until_s: float = 0.0  # lending its cores to a prefill until then
    prefilled_last: bool = False
    kv_reserved_tokens: int = 0  # of the requests routed to it, from placement to their end
    busy_s: float = 0.0
    decode_steps: int = 0
    decode_steps_s: float = 0.0
    meter: CostMeter = field(default_factory=CostMeter)

    @property
    def busy_until_s(self) -> Optional[float]:
        """The end of its step at the step's present speed; None between steps."""
        step = self.step
        return None if step is None else step.rated_s + max(0.0, step.work_s) / step.rate

    @property
    def idle(self) -> bool:
        return self.busy_until_s is None and not self.waiting and not self.running


class Simulation(CoreModel):
    def __init__(
        self, profile: Profile, shape: SystemShape, slo: SLO, node_cores: Optional[int] = None
    ):
        self.profile, self.shape, self.slo = profile, shape, slo
        self.node_cores = node_cores or profile.cores
        self.policy = CorePolicy(tpot_budget_s=slo.tpot_s)
        self.index = PrefixIndex()
        self.prefill = (
            [self._worker(f"prefill-{i}", "prefill") for i in range(shape.num_prefill)]
            if shape.mode == "disaggregated"
            else []
        )
        role = "decode" if shape.mode == "disaggregated" else "colocated"
        self.decode = [self._worker(f"{role}-{i}", role) for i in range(shape.num_decode)]
        self._place_on_nodes(self.prefill + self.decode)
        self._events: list = []
        self._order = itertools.count()
        # streams the router holds until a decode worker has KV room
        self._waiting_for_kv: deque = deque()
        self.now_s = 0.0

    def _worker(self, worker_id: str, role: str) -> _Worker:
        info = SimpleNamespace(worker_id=worker_id, block_size_tokens=BLOCK_SIZE_TOKENS)
        meter = CostMeter(self.shape.decode_interleave_tokens)
        return _Worker(WorkerHandle(actor=None, info=info), role, node=0, home=(), meter=meter)

    # -- the run ---------------------------------------------------------------------------------

    def run(self, requests: list[Request]) -> Report:
        self.streams = streams = []
        for request in requests:
            stream = _Stream(request, _hashes(request), request.arrival_s)
            streams.append(stream)
            if request.follows is None:
                self._send(stream)
            else:
                streams[request.follows].follower = stream
        while self._events:
            self.now_s, _, action, argument = heapq.heappop(self._events)
            action(argument)
            for worker in self.prefill + self.decode:
                if worker.busy_until_s is None and worker.paused_until_s <= self.now_s:
                    self._start_step(worker)
        return summarize(streams, self)

    def _send(self, stream: _Stream) -> None:
        """The client sends it at its arrival; the router places it after the serving path's fixed
        cost per request (`ServingCosts.request_s`)."""
        serving = self.profile.serving
        self._at(stream.arrival_s + (serving.request_s if serving else 0.0), self._arrive, stream)

    def _at(self, time_s: float, action, argument) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), action, argument))

    def _arrive(self, stream: _Stream) -> bool:
        """Places the request; False when its decode worker has no KV room (the router holds it)."""
        hashes = (
            stream.hashes[: stream.request.prompt_tokens // BLOCK_SIZE_TOKENS]
            if self.shape.routing == "prefix"
            else []
        )
        tokens = stream.request.prompt_tokens
        routing = self.shape.routing_config
        local = rank(
            routing, self.index, [w.handle for w in self.decode], hashes, tokens, "decode"
        )[0]
        path = "local"
        if self.shape.mode == "disaggregated":
            remote = rank(
                routing, self.index, [w.handle for w in self.prefill], hashes, tokens, "prefill"
            )[0]
            path = decide(
                self.shape.pd,
                tokens,
                Side(
                    remote.worker.queued_prompt_tokens,
                    remote.cached_tokens,
                    self._costs(remote),
                    self._link_s(tokens - local.cached_tokens),
                ),
                Side(local.worker.queued_prompt_tokens, local.cached_tokens, self._costs(local)),
                self.slo.ttft_s,
            ).path
        decode = self._by_handle(local.worker)
        if not self._reserve(decode, stream):
            self._waiting_for_kv.append(stream)
            return False
        decode.handle.in_flight += 1
        if path == "remote":
            prefill = self._by_handle(remote.worker)
            prefill.handle.queued_prompt_tokens += tokens
            prefill.handle.in_flight += 1
            stream.computed_tokens = remote.cached_tokens
            stream.decode_worker = decode  # where its KV goes
            prefill.waiting.append(stream)
        else:
            decode.handle.queued_prompt_tokens += tokens
            stream.computed_tokens = local.cached_tokens
            stream.decode_worker = decode
            decode.waiting.append(stream)
        return True

    def _costs(self, candidate) -> WorkerCosts:
        """A candidate worker's costs as its engine loop would report them now."""
        worker = self._by_handle(candidate.worker)
        slack_s = (
            self._slack_s(worker, self.now_s, worker.meter.decode_step_s)
            if worker.running
            else math.inf
        )
        return worker.meter.costs(slack_s)

    def _reserve(self, decode: _Worker, stream: _Stream) -> bool:
        """The decode side reserves the request's blocks first (`Profile.kv_capacity_tokens` each):
        no room, and the router holds the request (first come, first served) until some is freed."""
        capacity = self.profile.kv_capacity_tokens
        tokens = _blocks(stream.request.prompt_tokens + stream.request.output_tokens)
        tokens *= BLOCK_SIZE_TOKENS
        if capacity is not None and decode.kv_reserved_tokens + tokens > capacity:
            if decode.kv_reserved_tokens == 0:
                raise ValueError(
                    f"a request of {tokens} tokens does not fit a decode worker's KV cache "
                    f"({capacity} tokens)"
                )
            return False
        decode.kv_reserved_tokens += tokens
        stream.kv_reserved_tokens = tokens
        return True

    def _by_handle(self, handle: WorkerHandle) -> _Worker:
        return next(w for w in self.prefill + self.decode if w.handle is handle)

    # -- a worker's next step, as engine.scheduler.Scheduler.schedule picks it ---------------------

    def _start_step(self, worker: _Worker) -> None:
        budget = self.shape.max_num_batched_tokens
        interleave = self.shape.decode_interleave_tokens
        if worker.role == "prefill" or interleave is None or not worker.running:
            batch = self._prefill_batch(worker, budget) or self._decode_batch(worker)
        elif worker.prefilled_last:
            batch = self._decode_batch(worker) or self._prefill_batch(
                worker, min(interleave, budget)
            )
        else:
            batch = self._prefill_batch(worker, min(interleave, budget)) or self._decode_batch(
                worker
            )
        if batch is None:
            return
        is_prefill, chunks = batch
        worker.prefilled_last = is_prefill
        for stream, _ in chunks if is_prefill else ():
            if stream.queue_s is None:
                stream.queue_s = self.now_s - stream.arrival_s
        duration_s = self._duration_s(worker, is_prefill, chunks)
        worker.step = _Step(is_prefill, chunks, self.now_s, duration_s, rated_s=self.now_s)
        self._share_cores(worker.node)

    def _prefill_batch(self, worker: _Worker, budget: int):
        chunks = []
        shared, full_budget = self.shape.cpu_prefill_batch_tokens, budget
        for stream in self._prefill_order(worker):
            if budget == 0:
                break
            left = stream.request.prompt_tokens - stream.computed_tokens
            if chunks and shared is not None and full_budget - budget + left > shared:
                break  # as engine.scheduler does on a CPU: first come, first served
            chunk = min(left, budget)
            chunks.append((stream, chunk))
            budget -= chunk
        return (True, chunks) if chunks else None

    def _prefill_order(self, worker: _Worker) -> list:
        """As a worker's scheduler orders its prompts: a prefill worker's by their TTFT deadlines
        under `SystemShape.prefill_order` "slo" (engine.deadlines), first come first served
        otherwise (a decode worker's local prompts carry none)."""
        if worker.role != "prefill" or self.shape.prefill_order != "slo":
            return list(worker.waiting)
        queued = [
            Queued(
                stream,
                stream.request.prompt_tokens - stream.computed_tokens,
                stream.arrival_s + self.slo.ttft_s,
                stream.arrival_s,
                stream.computed_tokens > 0,
            )
            for stream in worker.waiting
        ]
        return deadline_order(queued, self.now_s, worker.meter.prefill_token_s or 0.0)

    def _decode_batch(self, worker: _Worker):
        return (False, [(stream, 1) for stream in worker.running]) if worker.running else None

    # -- step ends -------------------------------------------------------------------------------

    def _step_done(self, argument) -> None:
        worker, step, version = argument
        if worker.step is not step or step.version != version:
            return  # its end moved (shared cores)
        is_prefill, chunks = step.is_prefill, step.chunks
        duration_s = self.now_s - step.started_s
        worker.step = None
        worker.busy_s += duration_s
        self._share_cores(worker.node)
        if not is_prefill:
            worker.decode_steps += 1
            worker.decode_steps_s += duration_s
            worker.meter.decode_step(duration_s)
        else:
            worker.meter.prefill_step(sum(chunk for _, chunk in chunks), duration_s)
        for stream, chunk in chunks:
            if not is_prefill:
                self._emit(stream)
                if stream.done:
                    self._finish(worker, stream)
                continue
            stream.computed_tokens += chunk
            if stream.computed_tokens < stream.request.prompt_tokens:
                continue
            worker.waiting.remove(stream)
            worker.handle.queued_prompt_tokens -= stream.request.prompt_tokens
            self._store(worker, stream, stream.request.prompt_tokens)
            self._emit(stream)  # the first token
            if worker.role == "prefill":
                worker.handle.in_flight -= 1
                if stream.done:
                    self._finish(stream.decode_worker, stream)
                else:
                    self._at(self.now_s + self._handoff_s(stream), self._kv_ready, stream)
            elif stream.done:
                self._finish(worker, stream)
            else:
                stream.decode_started_s = self.now_s
                worker.running.append(stream)

    def _emit(self, stream: _Stream) -> None:
        stream.token_times_s.append(self.now_s + self.profile.router_cpu_s_per_token)

    def _handoff_s(self, stream: _Stream) -> float:
        held = self.index.cached_blocks(
            stream.hashes[: stream.request.prompt_tokens // BLOCK_SIZE_TOKENS],
            [stream.decode_worker.handle.worker_id],
        ).get(stream.decode_worker.handle.worker_id, 0)
        blocks = -(-stream.request.prompt_tokens // BLOCK_SIZE_TOKENS) - held
        return self._kv_bytes_handoff_s(
            blocks * BLOCK_SIZE_TOKENS * self.profile.kv_bytes_per_token
        )

    def _link_s(self, tokens: int) -> float:
        """What the router would predict for this prompt's handoff: nothing on one host (its links
        show what handoffs cost there only once measured), the wire where `--link` says."""
        if self.shape.link is None:
            return 0.0
        blocks = -(-max(0, tokens) // BLOCK_SIZE_TOKENS)
        return self._kv_bytes_handoff_s(
            blocks * BLOCK_SIZE_TOKENS * self.profile.kv_bytes_per_token
        )

    def _kv_bytes_handoff_s(self, kv_bytes: int) -> float:
        """The profiled handoff, plus the wire where the pools sit on two hosts (`--link`)."""
        link = self.shape.link
        wire_s = link.wire_s(kv_bytes) if link is not None else 0.0
        return self.profile.handoff_s(kv_bytes, self.shape.transport) + wire_s

    def _kv_ready(self, stream: _Stream) -> None:
        worker = stream.decode_worker
        self._store(worker, stream, stream.request.prompt_tokens)
        stream.decode_started_s = self.now_s
        worker.running.append(stream)

    def _finish(self, worker: _Worker, stream: _Stream) -> None:
        if stream.follower is not None:
            stream.follower.arrival_s = stream.token_times_s[-1] + stream.follower.request.think_s
            self._send(stream.follower)
        if stream in worker.running:
            worker.running.remove(stream)
        worker.handle.in_flight -= 1
        worker.kv_reserved_tokens -= stream.kv_reserved_tokens
        while self._waiting_for_kv:  # first come, first served: the oldest first, until one fails
            if not self._arrive(self._waiting_for_kv.popleft()):
                self._waiting_for_kv.rotate(1)  # back to the head of the line
                break
        self._store(worker, stream, stream.request.prompt_tokens + stream.request.output_tokens)

    def _store(self, worker: _Worker, stream: _Stream, tokens: int) -> None:
        if self.shape.routing == "prefix":
            self.index.apply(
                worker.handle.worker_id,
                ((True, h) for h in stream.hashes[: tokens // BLOCK_SIZE_TOKENS]),
            )

    @property
    def workers(self) -> list[_Worker]:
        return self.prefill + self.decode


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE_TOKENS)


def _hashes(request: Request) -> list[bytes]:
    """The conversation's block chain: a later turn's prompt starts with the same blocks, and every
    conversation with the blocks of the shared prefix (a system prompt)."""
    total = request.prompt_tokens + request.output_tokens
    shared = request.shared_prefix_tokens // BLOCK_SIZE_TOKENS
    return [
        (f"shared:{i}" if i < shared else f"{request.conversation}:{i}").encode()
        for i in range(total // BLOCK_SIZE_TOKENS)
    ]


def simulate(
    profile: Profile,
    shape: SystemShape,
    slo: SLO,
    requests: list[Request],
    node_cores: Optional[int] = None,
) -> Report:
    return Simulation(profile, shape, slo, node_cores).run(requests)
