"""The whole topology in one builder: a Ray cluster (started or joined), the prefill and decode pools,
and the router with its gRPC server. `pdserve serve`, the demo and the integration tests all use it.

The driver process hosts the router (no torch is imported here); each worker is a Ray actor with its
own torch threads sized to the CPUs it was granted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
TRANSPORTS = ("ray", "grpc")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "default"
    dtype: str = "float32"
    mode: str = "disaggregated"
    transport: str = "ray"
    num_prefill: int = 1
    num_decode: int = 1
    cpus_per_worker: float = 1.0
    address: str = "local"  # "local": start a Ray node here; "auto" or host:port: join that cluster
    host: str = "127.0.0.1"
    port: int = 50051
    kv_host: str = "127.0.0.1"  # where decode workers' gRPC KV receivers bind (grpc transport)
    kv_cache_bytes: int = 256 << 20
    block_size_tokens: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    object_store_bytes: int = 512 << 20
    autoscale: Optional[object] = None  # a router.autoscaler.AutoscaleConfig turns the autoscaler on

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError("need at least one decode worker, and one prefill worker when disaggregated")

    def engine_config(self):
        from engine.llm_engine import EngineConfig  # imported inside the workers' processes only

        return EngineConfig(model=self.model, dtype=self.dtype, block_size_tokens=self.block_size_tokens,
                            kv_cache_bytes=self.kv_cache_bytes, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens)


def init_ray(config: ServeConfig) -> None:
    if config.address == "local":
        # Every server on loopback (DESIGN.md). Ray reads this when it is imported, so it must be set
        # before the first `import ray` in this process (tests/conftest.py sets it for the test run).
        if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
            log.warning("ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set: its servers may not stay on loopback")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
    import ray

    if ray.is_initialized():
        return
    if config.address == "local":
        workers = config.num_decode + (config.num_prefill if config.mode == "disaggregated" else 0)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(workers * config.cpus_per_worker + 0.999)),
                 include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=config.object_store_bytes,
                 log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=config.address, log_to_driver=False, configure_logging=False)


@dataclass
class System:
    config: ServeConfig
    router: object
    server: object
    port: int
    health: object
    pools: object  # pdserve.pools.PoolManager
    autoscaler: Optional[object] = None  # pdserve.pools.AutoscaleLoop

    async def stats(self):
        from pdserve_proto import pdserve_pb2 as pb

        router = self.router
        now = time.monotonic()
        response = pb.GetStatsResponse(mode=self.config.mode, transport=self.config.transport, model=self.config.model,
                                       requests_in_flight=len(router.in_flight),
                                       requests_completed=router.requests_completed,
                                       requests_failed=router.requests_failed,
                                       autoscaler_decisions=self.autoscaler.decisions if self.autoscaler else [],
                                       requests_waiting_for_kv=router.waiting_for_kv,
                                       recent_ttft_p50_s=router.recent_p50(router.recent_first_tokens, now) or 0.0,
                                       recent_tpot_p50_s=router.recent_p50(router.recent_tpots, now) or 0.0)
        for pool in (router.prefill_pool, router.decode_pool):
            loads = await asyncio.gather(*(w.actor.load.remote() for w in pool.workers), return_exceptions=True)
            for worker, load in zip(pool.workers, loads):
                stats = response.workers.add(worker_id=worker.worker_id, role=worker.info.role, node=worker.info.node,
                                             state=worker.state if not isinstance(load, Exception) else "dead")
                if not isinstance(load, Exception):
                    worker.kv_blocks_free = load.kv_blocks_free
                    stats.running_requests = load.running_requests
                    stats.waiting_requests = load.waiting_requests
                    stats.kv_blocks_total = load.kv_blocks_total
                    stats.kv_blocks_free = load.kv_blocks_free
                    stats.requests_served = load.requests_served
                    stats.max_batch_size_seen = load.max_batch_size_seen
        return response

    async def stop(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop()
        await self.server.stop(grace=2.0)
        self.pools.stop_all()


async def start_system(config: ServeConfig) -> System:
    init_ray(config)  # before anything imports ray: the loopback setting is read at import

    from engine.tokenizer import load_tokenizer
    from pdserve.pools import AutoscaleLoop, PoolManager
    from router.grpc_server import GenerationServicer, mark_serving, start_grpc_server
    from router.pool import WorkerPool
    from router.router import Router, RouterConfig
    from router.validation import ValidationLimits

    started = time.monotonic()
    tokenizer = load_tokenizer(config.model)
    decode_role = "decode" if config.mode == "disaggregated" else "colocated"
    router = Router(RouterConfig(config.mode), tokenizer, WorkerPool("prefill"), WorkerPool(decode_role))
    pools = PoolManager(config, router, epoch=int(time.time()))
    await asyncio.gather(pools.add_workers(decode_role, config.num_decode),
                         pools.add_workers("prefill", config.num_prefill if config.mode == "disaggregated" else 0))
    info = router.decode_pool.workers[0].info
    limits = ValidationLimits(max_context_tokens=info.max_context_tokens, vocab_size=info.vocab_size)
    system = System(config, router, None, 0, None, pools)
    servicer = GenerationServicer(router, limits, system.stats, pools.scale)
    system.server, system.port, system.health = await start_grpc_server(servicer, config.host, config.port)
    if config.autoscale is not None:
        system.autoscaler = AutoscaleLoop(pools, config.autoscale)
        system.autoscaler.start()
    await mark_serving(system.health)
    log.info("pdserve ready on %s:%d (%s, %s transport, %d prefill + %d decode) in %.1f s", config.host, system.port,
             config.mode, config.transport, len(router.prefill_pool.workers), len(router.decode_pool.workers),
             time.monotonic() - started)
    return system
