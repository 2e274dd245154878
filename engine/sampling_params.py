"""`SamplingParams`: what a request asks of the sampler, validated when it is built. No torch: the
router validates requests with it."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import NamedTuple, Optional

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (vLLM's and OpenAI's limit)


class TokenLogprobs(NamedTuple):
    """One token's log-probability under the model (log-softmax of the raw fp32 logits: before temperature,
    top-k and top-p, as vLLM's default), and the `top` most likely tokens at that position, best first.
    A tuple, so it crosses process boundaries as a plain msgpack array."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)

    @classmethod
    def from_wire(cls, value) -> "TokenLogprobs":
        """From msgpack's arrays back to the typed tuple."""
        token_id, logprob, top = value
        return cls(token_id, logprob, tuple((t, lp) for t, lp in top))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities: None, not asked; N, each output token's own and its position's top N (0..20).
    logprobs: Optional[int] = None
    # The same for every prompt token (computed by the prefill pass; the first prompt token has none).
    prompt_logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or unset), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(
            not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop
        ):
            raise ValueError(
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or unset), got {value!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """These params with a seed fixed now if none was given (so all workers draw the same)."""
        if self.seed is not None or self.greedy:
            return self
        return dataclasses.replace(self, seed=random.getrandbits(63))
