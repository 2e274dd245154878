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
MAX_GUIDED_SPEC_CHARS = 64 << 10  # a schema, regex or the choices together
MAX_GUIDED_CHOICES = 256
MAX_PENALTY = 2.0  # presence and frequency penalties: in [-2, 2], OpenAI's range
MAX_LOGIT_BIAS = 100.0  # a logit_bias value: in [-100, 100], OpenAI's clamp
MAX_LOGIT_BIAS_TOKENS = 1024  # entries in one logit_bias (OpenAI's limit is smaller, 300)


@dataclass(frozen=True)
class GuidedDecoding:
    """Structured output: what every output token must keep the answer within, exactly one of a JSON
    schema (JSON text; `{"type": "object"}` for any object), a regular expression, or a list of
    choices. Compiled into a grammar by `engine.guided` (llguidance) where tokens are sampled.

    `prompt_tokens`: the request's own prompt length, set by the router. A migrated request is
    re-prefilled as its prompt plus the tokens already sent; the tokens past `prompt_tokens` are
    output, and a fresh matcher is advanced over them, so the grammar resumes where it was."""

    json_schema: Optional[str] = None
    regex: Optional[str] = None
    choice: tuple[str, ...] = ()
    prompt_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        given = [self.json_schema is not None, self.regex is not None, bool(self.choice)]
        if sum(given) != 1:
            raise ValueError("guided must hold exactly one of json_schema, regex or choice")
        size = sum(len(s) for s in (self.json_schema or "", self.regex or "", *self.choice))
        if size > MAX_GUIDED_SPEC_CHARS:
            raise ValueError(f"guided is larger than {MAX_GUIDED_SPEC_CHARS} characters")
        if len(self.choice) > MAX_GUIDED_CHOICES or any(not c for c in self.choice):
            raise ValueError(
                f"guided choice must hold at most {MAX_GUIDED_CHOICES} non-empty strings"
            )
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise ValueError(f"guided prompt_tokens must be >= 1, got {self.prompt_tokens!r}")

    @property
    def kind(self) -> str:
        if self.json_schema is not None:
            return "json_schema"
        return "regex" if self.regex is not None else "choice"

    def output_so_far(self, prompt_ids: list[int]) -> list[int]:
        """The tokens of an engine's prompt that were output before (a migrated request's), which
        the grammar must have consumed before it samples."""
        if self.prompt_tokens is None:
            return []
        return list(prompt_ids[self.prompt_tokens :])


class TokenLogprobs(NamedTuple):
    """One token's log-probability under the model (log-softmax of the raw fp32 logits: before
    temperature, top-k and top-p, as vLLM's default), and the `top` most likely tokens at that
    position, best first. A tuple, so it crosses process boundaries as a plain msgpack array."""

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
    # Log-probabilities: None, not asked; N, each output token's own and its position's top N
    # (0..20).
    logprobs: Optional[int] = None
    # The same for every prompt token (computed by the prefill pass; the first prompt token has
    # none).
    prompt_logprobs: Optional[int] = None
    # Structured output: the grammar every output token keeps to (None: free text).
    guided: Optional[GuidedDecoding] = None
    # Penalties and biases (engine/penalties.py), applied to the logits before temperature, so the
    # logprobs see them: OpenAI's presence and frequency penalties over the output tokens, vLLM's
    # repetition penalty over prompt and output, a bias per token id, EOS and stop ids refused
    # until `min_tokens` tokens are out, and vLLM's min_p (tokens below min_p x the top token's
    # probability dropped, after temperature).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    min_p: float = 0.0
    # The request's own prompt length, set by the router where the output's counts matter: a
    # migrated request is re-prefilled as its prompt plus the tokens already sent, and the tokens
    # past `prompt_tokens` count as output (None: the engine's prompt is all prompt).
    prompt_tokens: Optional[int] = None

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
                f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings of at most "
                f"{MAX_STOP_STRING_CHARS} characters"
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

        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                    f"got {getattr(self, name)!r}"
                )
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], "
                f"got {self.min_tokens!r}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias must hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                f"got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias must map token ids >= 0 to biases in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {token_id}: {bias!r}"
                )
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether its logits are changed before sampling (penalties, biases, min_tokens): a batch
        where no request does skips that work entirely."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    def output_so_far(self, prompt_ids: list[int]) -> list[int]:
        """The tokens of an engine's prompt that were output before (a migrated request's)."""
        return [] if self.prompt_tokens is None else list(prompt_ids[self.prompt_tokens :])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> "SamplingParams":
        """These params with a seed fixed now if none was given (so all workers draw the same)."""
        if self.seed is not None or self.greedy:
            return self
        return dataclasses.replace(self, seed=random.getrandbits(63))
