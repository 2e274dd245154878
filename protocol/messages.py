"""The typed replies of router -> worker calls (Ray actor calls; the requests are in `requests`):
what a worker says about itself (`WorkerInfo`), its load (`WorkerLoad`), and a prefill's answer
(`PrefillResult`). Replies are values, not exceptions: a decode worker without room for a
reservation answers None (`DecodeWorker.reserve`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class WorkerCosts:
    """What a worker's steps cost lately, measured where they run (runtime/costs.py), for the
    router's decision where a prompt prefills (router/pd_policy.py). A prefill worker sends them
    with each `PrefillResult`, a decode worker with each message of its token stream."""

    # seconds per prompt token of its recent prefill steps (None: it has prefilled nothing yet)
    prefill_token_s: Optional[float] = None
    decode_step_s: Optional[float] = None  # its recent decode steps (None: none yet)
    # How long its decoding streams could wait for a prompt now and still meet their share of the
    # TPOT target (runtime.cores.decode_slack_s): inf when nothing decodes, 0 when they cannot
    # wait (or no target is known)
    decode_slack_s: float = math.inf
    # prompt tokens it computes between two decode steps while streams decode (its scheduler's
    # decode_interleave_tokens; None: no interleaving, the whole token budget)
    interleave_tokens: Optional[int] = None


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns as soon as a prompt's first token is sampled."""

    worker_id: str
    first_token_id: int
    finish_reason: Optional[str]  # set when the request already finished at its first token
    num_cached_prompt_tokens: int
    queue_s: float
    prefill_s: float
    kv_bytes: int
    # time.time() the KV handoff started (wall clock: comparable across processes)
    kv_sent_wall_s: float
    # The worker's KV hash events since its previous result ((stored?, hash), oldest first): the
    # router's prefix index of the prefill pool is fed from these (protocol/token_stream.py's
    # KVEvent).
    kv_events: tuple[tuple[bool, bytes], ...] = ()
    # Asked for by the request (engine.sampling_params.TokenLogprobs, plain tuples here): the first
    # token's, and the prompt's (one per prompt token, the first None).
    first_token_logprobs: Optional[tuple] = None
    prompt_logprobs: Optional[tuple] = None
    costs: WorkerCosts = WorkerCosts()  # the prefill worker's, at this result
    # the wire mode its KV groups went in ("+"-joined if they differ: a lossless group that did not
    # shrink goes as none), and the bytes on the wire (`kv_bytes` is the KV's own size)
    kv_wire: str = "none"
    kv_wire_bytes: int = 0


def kernels_line(kernels: tuple[tuple[str, str], ...]) -> str:
    """A worker's `kernels`, as logs and `pdserve status` print them."""
    return ", ".join(f"{op} {kernel}" for op, kernel in kernels) or "none (not a CPU)"


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    node: str
    # where KV senders reach this worker: host:port (grpc), `cuda:<GPU UUID>` (ray, its cache on a
    # GPU: senders on that GPU share their KV by CUDA IPC), else None
    kv_address: Optional[str]
    kv_blocks_total: int
    # what this worker serves: the model's context, or less if its KV cache holds less
    max_context_tokens: int
    vocab_size: int
    model_context_tokens: int = 0  # the model's own context
    num_threads: int = 1  # torch threads the worker computes with
    # the serving dtype, "auto" resolved: every worker of a system must agree
    dtype: str = "float32"
    block_size_tokens: int = 16  # tokens per KV block: the unit of prefix caching and of KV shipped
    kv_block_bytes: int = 0  # one block's KV, all layers
    # why `dtype`: "asked" or what "auto" saw (engine.weights.dtype_reason), and the CPU's ISA
    dtype_reason: str = ""
    # (op, kernel) for each native op it runs (engine/kernels.py), the fallback's name where none
    kernels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class GpuStats:
    index: int
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1, NVML's "percent of time a kernel ran" over its last sample period


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    running_requests: int
    waiting_requests: int
    kv_blocks_free: int
    kv_blocks_total: int
    requests_served: int
    max_batch_size_seen: int
    decode_steps: int = 0  # steps that decoded only (no prefill) since start, and their total time
    decode_steps_s: float = 0.0
    # engine steps run on cores borrowed from idle workers (runtime/cores.py)
    borrowed_core_steps: int = 0
    lent_core_wait_s: float = 0.0  # time this worker waited for a lent core to come back
    # decode pauses that lent this worker's cores to a prefill within its TPOT slack
    lent_pauses: int = 0
    lent_pauses_s: float = 0.0
    rss_bytes: int = 0  # the worker process's resident memory
    gpus: tuple[GpuStats, ...] = ()
    gpu_note: str = ""  # why `gpus` is empty ("no GPU (...)")
    # (op, kernel) for each native op (engine/kernels.py): a kernel disabled at run time shows its
    # fallback
    kernels: tuple[tuple[str, str], ...] = ()
