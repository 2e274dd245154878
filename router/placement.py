"""Placement: which worker of a pool takes a request's attempt (router/kv_index.py: the prefix it
holds against its load), and where a disaggregated attempt prefills (router/pd_policy.py: the two
pools' best candidates compared). Pure bookkeeping on what the router knows: no worker call."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional

from engine.deadlines import Queued, deadline_order  # torch-free
from router.kv_index import Candidate, PrefixIndex, RoutingConfig, prompt_hashes, rank
from router.links import Links, kv_bytes_shipped
from router.metrics import RouterMetrics
from router.pd_policy import Decision, PDPolicyConfig, Side, decide
from router.pools.workers import NoWorkerError, WorkerHandle, WorkerPool


@dataclass(frozen=True)
class Prompt:
    """One attempt's prompt as placement sees it: token ids, and their block hashes (prefix
    routing)."""

    ids: list[int]
    hashes: list[bytes]
    # Worker ids this attempt is pinned to (router/choices.py: the choices of an `n > 1` request go
    # where their first choice went, to share its prompt's cached blocks); those of a pool that are
    # ready are its only candidates, and a pool with none of them ready ranks all its workers.
    pinned: frozenset[str] = frozenset()


class Placement:
    def __init__(
        self,
        routing: RoutingConfig,
        pd: PDPolicyConfig,
        kv_index: PrefixIndex,
        prefill_pool: WorkerPool,
        decode_pool: WorkerPool,
        metrics: RouterMetrics,
        ttft_target_s: float,
        links: Optional[Links] = None,
    ):
        self.routing = routing
        self.links = links if links is not None else Links()  # what handoffs cost between nodes
        self._pd = pd
        # the SLO's TTFT: the PD policy weighs the prefill queue by it
        self._ttft_target_s = ttft_target_s
        self._kv_index = kv_index
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        self._metrics = metrics

    def prompt(self, prompt_ids: list[int], pinned: frozenset[str] = frozenset()) -> Prompt:
        workers = self.decode_pool.ready() or self.prefill_pool.ready()
        hashes = (
            prompt_hashes(self.routing, prompt_ids, workers[0].info.block_size_tokens)
            if workers
            else []
        )
        return Prompt(prompt_ids, hashes, pinned)

    def ranked(self, pool: WorkerPool, prompt: Prompt) -> list[Candidate]:
        """The pool's ready workers (the pinned ones, if any of them is ready), best first."""
        workers = pool.ready()
        workers = [w for w in workers if w.worker_id in prompt.pinned] or workers
        return rank(
            self.routing, self._kv_index, workers, prompt.hashes, len(prompt.ids), pool.role
        )

    def place(self, prompt: Prompt) -> Decision:
        """Where a disaggregated request's prompt is prefilled: the prefill pool, or its decode
        worker (each pool's best candidate compared: the queued prompt tokens it would wait for,
        what each holds of the prompt, the costs each reported)."""
        remote = next(iter(self.ranked(self.prefill_pool, prompt)), None)
        local = next(iter(self.ranked(self.decode_pool, prompt)), None)
        # the prefill worker's queue counts up to where this prompt would stand in it
        ahead = remote and _tokens_ahead(
            remote.worker, len(prompt.ids) - remote.cached_tokens, self._ttft_target_s
        )
        remote_side = _side(remote, ahead)
        if remote_side is not None and local is not None:
            remote_side = remote_side._replace(transfer_s=self._transfer_s(remote, local, prompt))
        decision = decide(
            self._pd,
            len(prompt.ids),
            remote_side,
            _side(local) or Side(0, 0),
            self._ttft_target_s,
        )
        self._metrics.pd_decisions.labels(decision.path, decision.reason).inc()
        return decision

    def _transfer_s(self, sender: Candidate, receiver: Candidate, prompt: Prompt) -> float:
        """The predicted handoff of the prompt's KV, less the blocks the receiver holds already,
        over the link between the two workers' nodes."""
        info = receiver.worker.info
        held_blocks = receiver.cached_tokens // info.block_size_tokens
        kv_bytes = kv_bytes_shipped(len(prompt.ids), held_blocks, info)
        return self.links.transfer_s(sender.worker.info.node, info.node, kv_bytes)

    def pick(self, pool: WorkerPool, prompt: Prompt) -> WorkerHandle:
        """The pool's best worker for this prompt; NoWorkerError when none is ready."""
        ranked = self.ranked(pool, prompt)
        if not ranked:
            raise NoWorkerError(f"no ready {pool.role} worker")
        self.chosen(pool.role, ranked[0])
        return ranked[0].worker

    def chosen(self, role: str, candidate: Candidate) -> None:
        """Counts why a worker of `role` was chosen (prefix hit, no hit, or load routing)."""
        reason = (
            "load"
            if self.routing.policy == "load"
            else "prefix_hit"
            if candidate.cached_tokens
            else "no_hit"
        )
        self._metrics.routing_decisions.labels(role, reason).inc()


def _side(candidate: Optional[Candidate], queued_tokens: Optional[int] = None) -> Optional[Side]:
    """`queued_tokens`: those of its queued prompt tokens the prompt waits for; None: all."""
    if candidate is None:
        return None
    worker = candidate.worker
    if queued_tokens is None:
        queued_tokens = worker.queued_prompt_tokens
    return Side(queued_tokens, candidate.cached_tokens, worker.costs)


def _tokens_ahead(worker: WorkerHandle, tokens: int, ttft_target_s: float) -> int:
    """The queued prompt tokens a prefill worker would compute before a prompt of `tokens` sent
    now with the SLO's TTFT as its deadline, the new prompt in its place in the worker's deadline
    order (engine.deadlines, reckoned at the worker's measured speed): the late prompts wait behind
    it, so a queue that holds them need not send it to the decode worker. All of them where the
    speed is not measured yet, or without a target (first come first served, prompts sent without
    deadlines, reckon alike: they go by arrival)."""
    token_s = worker.costs.prefill_token_s
    queued = list(worker.queued_prompts.values())
    if token_s is None or not queued or math.isinf(ttft_target_s):
        return worker.queued_prompt_tokens
    now_s = time.monotonic()
    # each entry's item its tokens, the new prompt's None; the worker is computing one of them
    # (a prompt leaves at its first token), the one sent first as far as the router can tell
    first = min(queued, key=lambda entry: entry.arrival_s)
    entries = [entry._replace(item=entry.tokens_left, begun=entry is first) for entry in queued]
    new = Queued(None, tokens, now_s + ttft_target_s, now_s, False)
    ahead = 0
    for entry_tokens in deadline_order([*entries, new], now_s, token_s):
        if entry_tokens is None:
            break
        ahead += entry_tokens
    return ahead
