"""Continuous batching: which sequences run in the next forward pass.

Policy: if prompts are waiting and fit, run a prefill batch of them under a token budget, chunking a
prompt that does not fit the budget; otherwise run one decode step over every running sequence.
While sequences are decoding, prefill is interleaved instead (with `decode_interleave_tokens`): a
prefill step takes at most that many prompt tokens and is always followed by a decode step, so a
long prompt arriving on a busy worker delays each running stream by one chunk at a time, not by its
whole prefill. Sequences join and leave the running batch between steps. When a decode step needs a
block and none is free, the most recently started sequence is preempted: its blocks are freed and it
is recomputed later (prefix caching makes that cheap).

Waiting prompts are taken first come, first served, unless they carry TTFT deadlines (a prefill
worker's do, from the SLO): then earliest deadline first among those that can still make theirs,
and the ones that cannot after them (`prefill_order`, engine/deadlines.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from engine.block_manager import BlockAllocator, OutOfBlocksError
from engine.deadlines import Queued, deadline_order
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Prompt tokens per prefill step while sequences are decoding, each such step followed by a
    # decode step; None: prefill-first with the whole budget (vLLM's classic policy), decodes wait.
    decode_interleave_tokens: Optional[int] = None
    # Prompts share a prefill step only while it holds at most this many prompt tokens in all (the
    # first prompt always goes, chunked at the budget); None: every waiting prompt the budget holds.
    # Where a step of this many tokens keeps the cores busy, a second prompt in it computes no
    # faster than after it and only holds back the first one's first token.
    prefill_batch_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        for name in ("decode_interleave_tokens", "prefill_batch_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass
class ScheduledBatch:
    is_prefill: bool
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: its prefill chunk, or 1 when decoding


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.allocator = allocator
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        # Seconds a prompt token takes to prefill here, as its worker measures them
        # (runtime/costs.py); None: not measured, the deadlines judged by the clock alone.
        self.prefill_token_s: Optional[float] = None
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # the last step was a prefill (interleaving: a decode step comes next)
        self._prefilled_last = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV (all but its last token) is in the cache: prefilled here or
        transferred in."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Optional[ScheduledBatch]:
        interleave = self.config.decode_interleave_tokens
        if interleave is None or not self.running:
            batch = (
                self._schedule_prefill(self.config.max_num_batched_tokens)
                or self._schedule_decode()
            )
        else:
            chunk = min(interleave, self.config.max_num_batched_tokens)
            if self._prefilled_last:
                batch = self._schedule_decode() or self._schedule_prefill(chunk)
            else:
                batch = self._schedule_prefill(chunk) or self._schedule_decode()
        self._prefilled_last = batch is not None and batch.is_prefill
        return batch

    def _schedule_prefill(self, budget: int) -> Optional[ScheduledBatch]:
        seqs, chunks = [], []
        shared, full_budget = self.config.prefill_batch_tokens, budget
        for seq in self.prefill_order():
            if budget == 0 or len(self.running) + len(seqs) >= self.config.max_num_seqs:
                break
            taken = full_budget - budget  # prompt tokens in the step so far
            if (
                seqs
                and shared is not None
                and (taken + seq.num_tokens - seq.num_computed_tokens > shared)
            ):
                break  # it would hold back the prompts before it
            if not seq.block_ids:
                try:
                    # every prompt position's logits: nothing from the prefix cache
                    if seq.wants_prompt_logprobs:
                        seq.block_ids = self.allocator.allocate(
                            self.allocator.blocks_needed(seq.num_tokens)
                        )
                        seq.num_cached_prompt_tokens = 0
                    else:
                        seq.block_ids, seq.num_cached_prompt_tokens = (
                            self.allocator.allocate_prompt(seq.token_ids)
                        )
                except OutOfBlocksError:
                    break  # it waits until running sequences free blocks
                seq.num_computed_tokens = seq.num_cached_prompt_tokens
            chunk = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
        return ScheduledBatch(True, seqs, chunks) if seqs else None

    def prefill_order(self) -> list[Sequence]:
        """The waiting prompts in the order prefill steps take them (`engine.deadlines`): first
        come, first served unless they carry TTFT deadlines."""
        if all(seq.ttft_deadline_s is None for seq in self.waiting):
            return list(self.waiting)
        queued = [
            Queued(
                seq,
                seq.num_tokens - seq.num_computed_tokens,
                seq.ttft_deadline_s,
                seq.arrival_time_s,
                bool(seq.block_ids or seq.output_token_ids),
            )
            for seq in self.waiting
        ]
        return deadline_order(queued, self.clock(), self.prefill_token_s or 0.0)

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            if self._reserve_slot(seq):  # otherwise it was preempted back to the waiting queue
                scheduled.append(seq)
        self.running = scheduled
        return ScheduledBatch(False, list(scheduled), [1] * len(scheduled)) if scheduled else None

    def _reserve_slot(self, seq: Sequence) -> bool:
        """Make room for `seq`'s next token, preempting the newest other sequences if needed."""
        while self.allocator.blocks_needed(seq.num_tokens) > len(seq.block_ids):
            try:
                seq.block_ids += self.allocator.allocate(1)
            except OutOfBlocksError:
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def after_prefill(self, batch: ScheduledBatch) -> list[Sequence]:
        """Account the computed chunks; returns the sequences whose prompt is now fully computed."""
        completed = []
        for seq, chunk in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += chunk
            self.allocator.register_computed(seq.token_ids, seq.block_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                self.waiting.remove(seq)
                completed.append(seq)
        return completed

    def after_decode(self, batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            seq.num_computed_tokens += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        # Its decoded tokens' full blocks become findable too: a conversation's next turn, which
        # resends this answer, finds them cached.
        self.allocator.register_computed(seq.token_ids, seq.block_ids, seq.num_computed_tokens)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        # Tail blocks first, so the prompt's prefix blocks stay cached the longest.
        self.allocator.free(list(reversed(seq.block_ids)))
        seq.block_ids = []
