"""A request's state inside one engine: its tokens, its KV blocks and how far it has got."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.sampling import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # prompt (or part of it) not yet in the KV cache
    RUNNING = "running"  # prompt computed; decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # of those, how many came from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    arrival_time_s: float = 0.0
    # When its first token is due (time.monotonic(), from the SLO's TTFT); None: no deadline. The
    # scheduler's prefill order goes by it (Scheduler.prefill_order).
    ttft_deadline_s: Optional[float] = None
    # Disaggregated prefill: after the first token, keep the KV for a handoff instead of decoding.
    hand_off_after_prefill: bool = False
    # Prompt logprobs (asked in params), of prompt tokens 1.. as the prefill's chunks compute them;
    # they leave with the first output token.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Structured output: its llguidance matcher (engine/guided.py), advanced over every output
    # token.
    matcher: Optional[Any] = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must score every prompt position (asked, and not yet sent: a sequence
        recomputed after a preemption has output tokens, its prompt's logprobs went out with the
        first)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
