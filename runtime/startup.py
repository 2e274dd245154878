"""What every worker actor does at start-up: size torch's threads to the CPUs Ray granted, build the
engine, and describe itself."""

from __future__ import annotations

import dataclasses
import gc
import logging
import socket
from typing import Optional

import torch

from engine import kernels
from engine.dtypes import dtype_reason, resolve_device
from engine.fused_ops import load_fused_ops
from engine.llm_engine import EngineConfig, LLMEngine
from engine.prefill_attention import load_prefill_kernel
from protocol.messages import WorkerInfo, kernels_line
from runtime.cores import CorePolicy, CoreShare
from runtime.cpus import usable_cpus

log = logging.getLogger(__name__)


def granted_cpus() -> int:
    """The torch threads for the CPUs Ray gave this actor: whole CPUs, at least 1 (a fraction of a
    CPU, as a local node's workers get by default, is one thread sharing its core), and at most the
    CPUs this process may use (runtime/cpus.py: a node may declare more CPUs to Ray than it has)."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    except Exception:  # not inside a Ray worker
        cpus = 1
    return max(1, min(int(cpus), usable_cpus()))


def start_engine(config: EngineConfig) -> LLMEngine:
    # Two torch processes each spinning two threads on two cores slow decode 10-20x
    # (docs/benchmarks-archive.md, 2026-12-02, SLO-aware core sharing): a worker uses exactly the
    # CPUs it was granted.
    threads = granted_cpus()
    torch.set_num_threads(threads)
    # before any kernel loads: a kernel that killed a worker of this node is marked bad, and one
    # that kills this worker will be (engine/kernels.py)
    kernels.watch_crashes()
    # "auto" resolves here, on the worker's node: cuda where Ray gave this actor a GPU (it asked for
    # one).
    config = dataclasses.replace(
        config, device=resolve_device(config.device), num_threads=threads, detokenize=False
    )
    engine = LLMEngine(config)  # the router detokenizes
    # torch, Ray and the model (330k objects) are here for the process's life: frozen, they are out
    # of the collector's full passes, each otherwise a 160 ms pause in the middle of a decode step.
    select_kernels(engine)
    gc.collect()
    gc.freeze()
    log.info(
        "engine ready: model %s on %s, %s (asked: %s; CPU: %s), %d threads, %d KV blocks (%d "
        "tokens), kernels: %s",
        config.model,
        config.device,
        engine.layout.dtype,
        config.dtype,
        torch.backends.cpu.get_cpu_capability(),
        threads,
        engine.allocator.num_blocks,
        engine.allocator.num_blocks * config.block_size_tokens,
        kernels_line(kernels.summary()),
    )
    return engine


def select_kernels(engine: LLMEngine) -> None:
    """Every op's kernel chosen (built and self-checked where new) before the first request, not
    during it; the model's load chose its linears' and decode attention's already."""
    if torch.device(engine.config.device).type != "cpu":
        return
    load_fused_ops()
    if engine.loaded.model.embed_tokens.weight.dtype == torch.bfloat16:
        load_prefill_kernel()


def share_cores(engine: LLMEngine, policy: CorePolicy) -> Optional[CoreShare]:
    """This worker's part in lending idle cores between the node's workers (runtime/cores.py); None
    on a GPU or with lending off."""
    if policy.lend == "off" or torch.device(engine.config.device).type != "cpu":
        return None
    try:
        return CoreShare(
            policy, engine.config.num_threads or torch.get_num_threads(), torch.set_num_threads
        )
    except OSError as error:  # no shared directory to agree in: compute on the home threads only
        log.warning("cores are not lent on this node: %s", error)
        return None


def describe(engine: LLMEngine, worker_id: str, role: str, kv_address: Optional[str]) -> WorkerInfo:
    """The worker's `info()`: who it is and what it can serve."""
    return WorkerInfo(
        worker_id,
        role,
        node_name(),
        kv_address,
        engine.allocator.num_blocks,
        engine.max_model_len,
        engine.model_config.vocab_size,
        engine.model_config.max_context_tokens,
        torch.get_num_threads(),
        engine.layout.dtype,
        engine.layout.block_size_tokens,
        engine.layout.bytes_per_block,
        _dtype_reason(engine.config),
        kernels.summary(),
    )


def _dtype_reason(config: EngineConfig) -> str:
    where = (
        torch.cuda.get_device_name(config.device)
        if torch.device(config.device).type == "cuda"
        else f"CPU {torch.backends.cpu.get_cpu_capability()}"
    )
    reason = dtype_reason(config.dtype, config.device)
    return reason if reason.startswith("auto") else f"{reason}; {where}"


def node_name() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()[:12]
    except Exception:
        return socket.gethostname()


def node_ip_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())
