"""Conditional disaggregation: where a disaggregated system prefills a request.

`remote`: on the prefill pool, its KV shipped to the decode worker (the default path). `local`: on
the decode worker that will decode it, interleaved with the streams it is decoding (the engine runs
a chunk of at most `decode_interleave_tokens` prompt tokens between decode steps), nothing shipped.

`auto` decides as DistServe, Dynamo and llm-d do, by what each path costs, here in the seconds the
two workers measured on their latest steps (`WorkerCosts`: seconds per prompt token, the decode
step, how long the decode worker's streams could wait within the TPOT target). A prompt goes local:
- when what is left to compute there is short (one interleaved chunk: a handoff costs more than it
  saves): a short prompt, or one whose prefix the decode worker holds already (a conversation's
  earlier turns, reported by its KV events: router/kv_index.py);
- or when its first token comes sooner there (the remote path's time counts its KV handoff over
  the link between the two workers' nodes, as learnt from earlier handoffs: router/links.py), its
  streams can wait that long, and either the prefill pool would miss the TTFT target (the prompts
  it would take first are many: with TTFT deadlines, those in its deadline order before the new
  prompt, which goes ahead of the ones already late), or shipping its KV would (a slow link:
  reason "link"), or the decode worker has less than half as much to compute (it holds a prefix
  the prefill pool lacks: its streams wait for that work, so it counts twice).
Otherwise remote: a prompt the prefill pool serves within the TTFT target never stalls the streams
(their inter-token tail is what disaggregation buys). The decision reads only numbers the router
already keeps (queued prompt tokens, the costs that come with results and token streams), so it
costs no worker call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

from protocol.messages import WorkerCosts

POLICIES = ("auto", "remote", "local")
# the prefill pool's queue order (router.router.RouterConfig.prefill_order)
PREFILL_ORDERS = ("slo", "fcfs")


@dataclass(frozen=True)
class PDPolicyConfig:
    policy: str = "auto"  # "remote": always the prefill pool; "local": always the decode worker
    # auto: prompts with at most this many tokens not cached on the decode worker prefill there (one
    # interleaved chunk of the scheduler's default: running streams wait for one chunk at most)
    local_max_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"--pd-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if self.local_max_prompt_tokens < 0:
            raise ValueError("local_max_prompt_tokens must be >= 0")


class Decision(NamedTuple):
    path: str  # "remote" or "local"
    # "policy", "short_prompt", "prefix_hit", "prefill_queue", "link", "no_prefill_worker" or
    # "default"
    reason: str


class Side(NamedTuple):
    """One path's best worker as the router sees it."""

    # prompt tokens routed there to prefill whose first token has not come back, those the prompt
    # would wait for: a prefill worker's in its deadline order (router/placement.py), all of them on
    # a decode worker (its local prompts go by arrival)
    queued_tokens: int
    cached_tokens: int  # of this prompt, what it holds already
    costs: WorkerCosts = WorkerCosts()
    # the remote side: the predicted KV handoff to the decode worker (router/links.py; 0 unknown)
    transfer_s: float = 0.0


def decide(
    config: PDPolicyConfig,
    prompt_tokens: int,
    remote: Optional[Side],
    local: Side,
    ttft_target_s: float = math.inf,
) -> Decision:
    """`remote`: the best prefill worker (None when the pool has none ready); `local`: the best
    decode worker; `ttft_target_s`: the SLO's TTFT."""
    if remote is None:  # whatever the policy: the system serves degraded, decode workers prefill
        return Decision("local", "no_prefill_worker")
    if config.policy != "auto":
        return Decision(config.policy, "policy")
    local_new = prompt_tokens - local.cached_tokens
    if local_new <= config.local_max_prompt_tokens:
        return Decision("local", "prefix_hit" if local.cached_tokens else "short_prompt")
    remote_new = prompt_tokens - remote.cached_tokens
    # Nothing measured yet: the two alike per token (the same model and engine), the prefill pool
    # taken to meet the target, and a unit of 1 s a token (only streams that nothing delays, none
    # decoding, can wait for it)
    remote_token_s = remote.costs.prefill_token_s or local.costs.prefill_token_s
    local_token_s = local.costs.prefill_token_s or remote_token_s or 1.0
    remote_token_s = remote_token_s or local_token_s
    local_tokens = local.queued_tokens + local_new
    if local_tokens * local_token_s > local.costs.decode_slack_s:
        return Decision("remote", "default")  # its streams cannot wait that long
    remote_ttft_s = (remote.queued_tokens + remote_new) * remote_token_s
    # when the decode worker can go on with it: the first token, then the KV over the link
    remote_ready_s = remote_ttft_s + remote.transfer_s
    if _local_ttft_s(local.costs, local_tokens, local_token_s) >= remote_ready_s:
        return Decision("remote", "default")
    if local.cached_tokens > remote.cached_tokens and (
        2 * local_new * local_token_s <= remote_new * remote_token_s
    ):
        return Decision("local", "prefix_hit")
    measured = remote.costs.prefill_token_s is not None
    if measured and remote_ttft_s > ttft_target_s:
        return Decision("local", "prefill_queue")
    if measured and remote_ready_s > ttft_target_s:  # the queue would make it; the link not
        return Decision("local", "link")
    return Decision("remote", "default")


def _local_ttft_s(costs: WorkerCosts, tokens: int, token_s: float) -> float:
    """When the decode worker's local prompts, this one last (`tokens` in all), would be computed:
    their chunks, and while streams decode there a decode step after each chunk."""
    work_s = tokens * token_s
    if math.isinf(costs.decode_slack_s) or not costs.interleave_tokens:
        return work_s  # nothing decodes: its whole token budget prefills
    chunks = math.ceil(tokens / costs.interleave_tokens)
    return work_s + chunks * (costs.decode_step_s or 0.0)
