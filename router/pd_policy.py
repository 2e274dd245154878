"""Conditional disaggregation: where a disaggregated system prefills a request.

`remote`: on the prefill pool, its KV shipped to the decode worker (the default path). `local`: on
the decode worker that will decode it, interleaved with the streams it is decoding (the engine runs
a chunk of at most `decode_interleave_tokens` prompt tokens between decode steps), nothing shipped.
DistServe, Dynamo and llm-d decide the same way: a prompt goes local when that is cheaper than the
remote path: when what is left to compute there is short (a handoff costs more than it saves): a
short prompt, or one whose prefix the decode worker holds already (a conversation's earlier turns,
reported by its KV events: router/kv_index.py); or when the prefill pool's queue is longer than the
decode worker's own, so the prompt would start sooner there. The decision is
a pure function of numbers the router already keeps (prompt tokens queued per worker), so it costs
no worker call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

POLICIES = ("auto", "remote", "local")


@dataclass(frozen=True)
class PDPolicyConfig:
    policy: str = "auto"  # "remote": always the prefill pool; "local": always the decode worker
    # auto: prompts with at most this many tokens not cached on the decode worker prefill there (one
    # interleaved chunk of the scheduler's default: running streams wait for one chunk at most)
    local_max_prompt_tokens: int = 256
    # auto: go local when the prefill pool's shortest queue exceeds the decode worker's own queue
    # (its local prompts not yet prefilled) plus this prompt by this many tokens
    queue_margin_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"--pd-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if self.local_max_prompt_tokens < 0 or self.queue_margin_tokens < 0:
            raise ValueError("local_max_prompt_tokens and queue_margin_tokens must be >= 0")


class Decision(NamedTuple):
    path: str  # "remote" or "local"
    # "policy", "short_prompt", "prefix_hit", "prefill_queue", "no_prefill_worker" or "default"
    reason: str


def decide(
    config: PDPolicyConfig,
    prompt_tokens: int,
    remote_queue_tokens: int | None,
    local_queue_tokens: int,
    remote_cached_tokens: int = 0,
    local_cached_tokens: int = 0,
) -> Decision:
    """`remote_queue_tokens`: prompt tokens queued on the best prefill worker (None when the pool
    has none); `local_queue_tokens`: those queued for local prefill on the best decode worker; the
    cached tokens: how much of this prompt each of the two holds already."""
    if config.policy != "auto":
        return Decision(config.policy, "policy")
    if remote_queue_tokens is None:
        return Decision("local", "no_prefill_worker")
    local_new = prompt_tokens - local_cached_tokens
    if local_new <= config.local_max_prompt_tokens:
        return Decision("local", "prefix_hit" if local_cached_tokens else "short_prompt")
    # Computed locally, the prompt also delays the decode worker's running streams by about as much
    # again: it counts twice there.
    if remote_queue_tokens + prompt_tokens - remote_cached_tokens >= (
        local_queue_tokens + 2 * local_new + config.queue_margin_tokens
    ):
        return Decision(
            "local", "prefix_hit" if local_cached_tokens > remote_cached_tokens else "prefill_queue"
        )
    return Decision("remote", "default")
