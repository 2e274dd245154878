"""The whole topology in one builder: a Ray cluster (started or joined), the prefill and decode
pools, and the router with its gRPC server. `pdserve serve`, the demo and the integration tests all
use it.

The driver process hosts the router (no torch is imported here); each worker is a Ray actor with its
own torch threads sized to the CPUs it was granted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.dtypes import DEVICES  # torch-free
from protocol.messages import kernels_line  # torch-free
from router.slo import DEFAULT_SLO, SLO  # torch-free
from runtime.cpus import usable_cpus  # torch-free

log = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
# a local node's default CPU share per worker is its cores / this (or / its workers)
_LOCAL_WORKER_SLOTS = 4
TRANSPORTS = ("ray", "grpc", "rdt")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "default"
    # bf16 where the workers' hardware has it natively, else fp32 (engine.dtypes.auto_dtype)
    dtype: str = "auto"
    # "cuda": each worker asks Ray for one GPU; "auto": cuda when the cluster has GPUs
    device: str = "auto"
    # no CUDA graphs for decode steps on GPUs (vLLM's flag of that name)
    enforce_eager: bool = False
    # batch-invariant kernels on every worker (engine/deterministic.py): greedy output identical
    # whatever the batching, migration or where a prompt prefills; CPU only, slower
    deterministic: bool = False
    mode: str = "disaggregated"
    transport: str = "ray"
    num_prefill: int = 1
    num_decode: int = 1
    # CPUs Ray accounts to each worker; None: on a local node a share of its cores that leaves room
    # to scale up (`worker_cpus`), on a cluster 1. A worker computes with max(1, whole CPUs) torch
    # threads.
    cpus_per_worker: Optional[float] = None
    # a new worker not ready by then (no room on the cluster?) is given up
    worker_start_timeout_s: float = 300.0
    address: str = "local"  # "local": start a Ray node here; "auto" or host:port: join that cluster
    host: str = "127.0.0.1"
    port: int = 50051
    # Where decode workers bind their token stream to the router and their gRPC KV receiver: "auto"
    # is 127.0.0.1 on a local node and each worker's node address on a cluster.
    kv_host: str = "auto"
    # per worker; None: a tenth of its node's available memory (<= 4 GiB)
    kv_cache_bytes: Optional[int] = None
    # a KV reservation's and a handoff lease's life (router.router.RouterConfig)
    kv_timeout_s: float = 30.0
    # how a request's KV goes on the wire (router/kv_wire.py): auto (per request, the mode that
    # delivers it sooner over the measured link), none, lossless, fp8, int8
    kv_wire: str = "auto"
    kv_wire_lossy: bool = False  # fp8 and int8 allowed (--kv-wire-lossy ok)
    block_size_tokens: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Decode and colocated workers prefill at most this many prompt tokens between two decode steps
    # while streams are decoding (engine.scheduler); None: prefill-first, streams wait for whole
    # prompts.
    decode_interleave_tokens: Optional[int] = 256
    # On a CPU, prompts share a prefill step up to this many tokens in all (engine.scheduler): a
    # step of 512 tokens keeps one core busy, so two prompts batched took as long as the two one
    # after the other, and the first waited for both (docs/benchmarks-archive.md); None: any that
    # fit
    cpu_prefill_batch_tokens: Optional[int] = 256
    # where disaggregated requests prefill: auto, remote, local (router/pd_policy.py)
    pd_policy: str = "auto"
    # the prefill queue's order (router.router.RouterConfig): slo or fcfs
    prefill_order: str = "slo"
    # auto: prompts with this few tokens not cached there prefill on their decode worker
    local_prefill_max_tokens: int = 256
    # which worker of a pool: prefix (cached prefix against load) or load (router/kv_index.py)
    routing: str = "prefix"
    # prefix routing: one cached prompt token offsets this many tokens of load
    prefix_weight: float = 1.0
    # prefix routing: a decode worker's running request weighs like this many tokens
    decode_stream_tokens: int = 64
    # Which engine steps may borrow cores another worker of the node was granted and is not using
    # (runtime/cores.py): all, prefill (only steps computing prompt tokens), off.
    lend_cores: str = "all"
    # where the node's workers agree on cores; None: /dev/shm/pdserve-cores-<uid>
    core_dir: Optional[str] = None
    object_store_bytes: int = 512 << 20
    # a router.pools.AutoscaleConfig turns the autoscaler on
    autoscale: Optional[object] = None
    # the OpenAI-compatible HTTP server (on `host`); None: off, 0: any free port
    http_port: Optional[int] = None
    # the model id of the HTTP API; default: the model file's name
    served_model_name: Optional[str] = None
    # whose tokenizer (and chat template) the router uses, as a model spec; None: the model's own
    # (a dummy: model has none, so it needs one: vLLM's --tokenizer)
    tokenizer: Optional[str] = None
    # a chat template replacing the tokenizer's: a file's path or the template itself (vLLM's
    # --chat-template), e.g. for a model whose own has no tool format
    chat_template: Optional[str] = None
    # data-plane keys; none: no key needed (allowed on loopback only)
    api_keys: tuple[str, ...] = ()
    admin_token: Optional[str] = None  # for Scale and other admin calls
    insecure: bool = False  # allow serving beyond loopback without keys
    tls_cert: Optional[str] = None  # PEM files: both set turns TLS on for the gRPC and HTTP servers
    tls_key: Optional[str] = None
    max_in_flight: int = 1024  # requests the router holds at once; beyond: RESOURCE_EXHAUSTED / 429
    max_waiting_for_kv: int = 256  # of those, queued for KV room on a decode worker
    stream_interval: int = 1  # decode tokens per streamed message (router.router.RouterConfig)
    # "ttft:MS,tpot:MS": what completed requests are judged against and decode workers lend cores
    # within; "auto": ttft:1000,tpot:50 where the workers serve bf16, ttft:4000,tpot:100 for fp32
    # CPUs (router/slo.py)
    slo: str = DEFAULT_SLO
    # one line per HTTP request and gRPC call on the `pdserve.access` logger (router/access_log.py)
    access_log: bool = True
    # export per-request traces by OTLP/gRPC to this collector (router/tracing.py); None: no tracing
    otlp_endpoint: Optional[str] = None

    @property
    def worker_cpus(self) -> float:
        """`cpus_per_worker` resolved. On a local node (which cannot grow) the default gives each
        worker a share of the cores sized for at least 4 workers, so the README's scale-up from 1
        prefill + 1 decode works on 2 cores (workers then share cores, one thread each); a real
        refusal names the numbers."""
        if self.cpus_per_worker is not None:
            return self.cpus_per_worker
        if self.address != "local":
            return 1.0
        workers = self.num_decode + (self.num_prefill if self.mode == "disaggregated" else 0)
        return usable_cpus() / max(_LOCAL_WORKER_SLOTS, workers)

    @property
    def pd(self):
        """The router's `PDPolicyConfig` (where disaggregated requests prefill)."""
        from router.pd_policy import PDPolicyConfig

        return PDPolicyConfig(self.pd_policy, self.local_prefill_max_tokens)

    @property
    def routing_config(self):
        """The router's `RoutingConfig` (which worker of a pool)."""
        from router.kv_index import RoutingConfig

        return RoutingConfig(self.routing, self.prefix_weight, self.decode_stream_tokens)

    @property
    def kv_wire_config(self):
        """The router's `KVWireConfig` (how KV goes on the wire)."""
        from router.kv_wire import KVWireConfig

        return KVWireConfig(self.kv_wire, self.kv_wire_lossy)

    @property
    def slo_target(self) -> SLO:
        """`slo` parsed: what the router judges completed requests against."""
        return SLO.resolve(self.slo, self.dtype, self.device)

    def worker_bind_host(self) -> Optional[str]:
        """`kv_host` as decode workers get it: None means their node's address."""
        if self.kv_host != "auto":
            return self.kv_host
        return "127.0.0.1" if self.address == "local" else None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}"
            )
        if self.transport == "rdt" and self.autoscale is not None:
            raise ValueError(
                "the rdt transport's workers are fixed at start (one Ray collective group): "
                "autoscaling needs --transport ray or grpc"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError(
                "need at least one decode worker, and one prefill worker when disaggregated"
            )
        if self.cpus_per_worker is not None and self.cpus_per_worker <= 0:
            raise ValueError(f"--cpus-per-worker must be positive, got {self.cpus_per_worker}")
        if self.model.startswith("dummy:") and self.tokenizer is None:
            raise ValueError(
                f"{self.model} has random weights and no tokenizer: pass --tokenizer "
                "(e.g. --tokenizer default, the embedded model's)"
            )
        if self.chat_template is not None:
            from engine.tokenizer import TokenizerError, compile_chat_template  # torch-free

            try:
                compile_chat_template(self.chat_template_text)
            except TokenizerError as error:
                raise ValueError(f"--chat-template: {error}") from None
        self.pd  # checks the policy's fields
        self.core_policy
        self.routing_config
        self.kv_wire_config
        self.slo_target
        if self.decode_interleave_tokens is not None and self.decode_interleave_tokens < 1:
            raise ValueError(
                f"--decode-interleave-tokens must be >= 1, got {self.decode_interleave_tokens}"
            )
        if self.kv_timeout_s <= 0:
            raise ValueError(f"kv_timeout_s must be positive, got {self.kv_timeout_s}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        from router.auth import check_bind

        check_bind(self.host, self.credentials, self.insecure)

    @property
    def credentials(self):
        from router.auth import Credentials

        return Credentials(tuple(self.api_keys), self.admin_token)

    @property
    def tls(self) -> Optional[tuple[str, str]]:
        return (self.tls_cert, self.tls_key) if self.tls_cert and self.tls_key else None

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from engine.default_model import resolve_model_path

        return (
            self.model if self.model.startswith("dummy:") else resolve_model_path(self.model).stem
        )

    @property
    def chat_template_text(self) -> Optional[str]:
        """`chat_template` read from its file when it names one."""
        if self.chat_template is None or "{" in self.chat_template:
            return self.chat_template
        path = Path(self.chat_template).expanduser()
        if not path.is_file():
            raise ValueError(
                f"--chat-template: {self.chat_template!r} is neither a file nor a template"
            )
        return path.read_text()

    @property
    def core_policy(self):
        from runtime.cores import CorePolicy  # torch-free

        return CorePolicy(
            self.lend_cores,
            self.core_dir,
            tpot_budget_s=self.slo_target.tpot_s,
        )

    def engine_config(self):
        from engine.config import EngineConfig  # torch-free: the router builds it

        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size_tokens=self.block_size_tokens,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            decode_interleave_tokens=self.decode_interleave_tokens,
            cpu_prefill_batch_tokens=self.cpu_prefill_batch_tokens,
            cuda_graphs=not self.enforce_eager,
            deterministic=self.deterministic,
        )


def _uvloop():
    """uvloop, where it is installed (the router's CPU per streamed token is about 13% lower on its
    loop, docs/benchmarks-archive.md); None elsewhere, and asyncio's own loop serves."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A loop of the router's kind."""
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()


def run_router_loop(main) -> None:
    """`asyncio.run` on the router's kind of event loop."""
    uvloop = _uvloop()
    (uvloop.run if uvloop else asyncio.run)(main)


def init_ray(config: ServeConfig) -> None:
    if config.address == "local":
        # Every server on loopback (docs/architecture.md, Serving). Ray reads this when it is
        # imported, so it must be set before the first `import ray` in this process
        # (tests/conftest.py sets it for the test run).
        if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
            log.warning(
                "ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set: its servers "
                "may not stay on loopback"
            )
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
    import ray

    if ray.is_initialized():
        return
    if config.address == "local":
        workers = config.num_decode + (config.num_prefill if config.mode == "disaggregated" else 0)
        local = dict(
            address="local",
            num_cpus=max(usable_cpus(), int(workers * config.worker_cpus + 0.999)),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=config.object_store_bytes,
            log_to_driver=False,
            configure_logging=False,
        )
        try:
            ray.init(**local)
        except Exception as error:  # Ray raises a bare Exception for this
            if (
                "timed out during startup" not in str(error)
                or os.environ["RAY_preallocate_plasma_memory"] == "0"
            ):
                raise
            # The raylet gives its object store 10 s to open its socket, and preallocating the
            # store's pages can take longer where memory pages in slowly (seen: 9.3 s for 512 MB on
            # this VM).
            log.warning(
                "Ray's local node did not start (%s): starting it again without preallocating the "
                "object store",
                error,
            )
            ray.shutdown()
            os.environ["RAY_preallocate_plasma_memory"] = "0"
            ray.init(**local)
    else:
        ray.init(address=config.address, log_to_driver=False, configure_logging=False)


@dataclass
class System:
    config: ServeConfig
    router: object
    server: object
    port: int
    health: object
    pools: object  # router.pools.PoolManager
    # router.validation.ValidationLimits: what every request is checked against
    limits: Optional[object] = None
    autoscaler: Optional[object] = None  # router.pools.AutoscaleLoop
    http_runner: Optional[object] = None  # aiohttp AppRunner of the OpenAI-compatible server
    http_port: Optional[int] = None
    tracer: Optional[object] = None  # router.tracing.RequestTracer: --otlp-endpoint
    ready: bool = False

    def ready_line(self) -> str:
        """What a user needs to know once serving, as vLLM's start log says it: where, the dtype and
        why, the context served, and each pool's threads and KV tokens per worker."""
        config, router = self.config, self.router
        http = f", HTTP port {self.http_port}" if self.http_port else ""
        pools = []
        for pool in (router.prefill_pool, router.decode_pool):
            if pool.workers:
                infos = [w.info for w in pool.workers]
                threads = sorted({i.num_threads for i in infos})
                kv_tokens = min(i.kv_blocks_total * i.block_size_tokens for i in infos)
                kernels = sorted({kernels_line(i.kernels) for i in infos})
                pools.append(
                    f"{len(infos)} {pool.role} x {'/'.join(map(str, threads))} thread(s), "
                    f"{kv_tokens} KV tokens each, kernels: {' | '.join(kernels)}"
                )
        info = (router.decode_pool.workers or router.prefill_pool.workers)[0].info
        return (
            f"pdserve ready on {config.host}: gRPC port {self.port}{http}; {config.mode}, "
            f"{config.transport} transport; {'; '.join(pools)}; dtype {info.dtype} "
            f"({info.dtype_reason}); context {self.limits.max_context_tokens} tokens (model "
            f"{self.limits.model_context_tokens}); SLO {router.config.slo}"
        )

    async def worker_loads(self) -> list:
        """(handle, WorkerLoad or the exception it raised) for every worker of both pools, asked at
        once."""
        workers = [
            w for pool in (self.router.prefill_pool, self.router.decode_pool) for w in pool.workers
        ]
        loads = await asyncio.gather(
            *(w.actor.load.remote() for w in workers), return_exceptions=True
        )
        for worker, load in zip(workers, loads):
            if not isinstance(load, BaseException):
                worker.kv_blocks_free = load.kv_blocks_free
        return list(zip(workers, loads))

    async def metrics_snapshot(self):
        from router.metrics import Snapshot, WorkerRow

        rows = [
            WorkerRow(w.worker_id, w.info.role, "dead", None)
            if isinstance(load, BaseException)
            else WorkerRow(w.worker_id, w.info.role, w.state.value, load, w.costs)
            for w, load in await self.worker_loads()
        ]
        stats = self.router.stats()
        return Snapshot(
            rows,
            stats.requests_in_flight,
            stats.requests_waiting_for_kv,
            self.router.links(),
            self.pools.degraded(),
        )

    async def stats(self):
        from pdserve_proto import pdserve_pb2 as pb

        router = self.router
        stats = router.stats()
        response = pb.GetStatsResponse(
            mode=self.config.mode,
            transport=self.config.transport,
            model=self.config.model,
            requests_in_flight=stats.requests_in_flight,
            requests_completed=stats.requests_completed,
            requests_failed=stats.requests_failed,
            autoscaler_decisions=self.autoscaler.decisions if self.autoscaler else [],
            requests_waiting_for_kv=stats.requests_waiting_for_kv,
            recent_ttft_p50_s=stats.ttft_p50_s or 0.0,
            recent_tpot_p50_s=stats.tpot_p50_s or 0.0,
            max_context_tokens=self.limits.max_context_tokens,
            model_context_tokens=self.limits.model_context_tokens,
            slo=str(router.config.slo),
            slo_met=stats.slo_met,
            slo_finished=stats.slo_finished,
            degraded=[f"{pool}: {why}" for pool, why in sorted(self.pools.degraded().items())],
        )
        for (sender, receiver), link in sorted(router.links().items()):
            response.links.add(
                sender_node=sender,
                receiver_node=receiver,
                latency_s=link.latency_s,
                bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                handoffs=link.handoffs,
                last_bytes=link.last_bytes,
                last_s=link.last_s,
            )
        for worker, load in await self.worker_loads():
            failed = isinstance(load, BaseException)
            stats = response.workers.add(
                worker_id=worker.worker_id,
                role=worker.info.role,
                node=worker.info.node,
                state=worker.state.value if not failed else "dead",
                threads=worker.info.num_threads,
                cpus=self.config.worker_cpus,
                kv_capacity_tokens=worker.info.kv_blocks_total * self.config.block_size_tokens,
            )
            if not failed:
                stats.running_requests = load.running_requests
                stats.waiting_requests = load.waiting_requests
                stats.kv_blocks_total = load.kv_blocks_total
                stats.kv_blocks_free = load.kv_blocks_free
                stats.requests_served = load.requests_served
                stats.max_batch_size_seen = load.max_batch_size_seen
                stats.kernels = kernels_line(load.kernels)
        return response

    async def stop(self) -> None:
        if self.autoscaler is not None:
            self.autoscaler.stop()
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.server is not None:
            await self.server.stop(grace=2.0)
        self.pools.stop_all()
        if self.tracer is not None:
            self.tracer.shutdown()  # exports the last spans
        gc.unfreeze()  # what start_system froze may be garbage now


class PortInUseError(OSError):
    """A port the system is told to serve on is taken: found before anything starts."""


def check_ports_free(config: ServeConfig) -> None:
    """Binds each fixed port once and lets it go, so a taken one fails in milliseconds, before Ray
    and the workers start (port 0 picks a free one later). No SO_REUSEPORT here: gRPC sets it on its
    own sockets, and a second server would otherwise share a running one's port silently."""
    import socket

    for name, port in (("gRPC", config.port), ("HTTP", config.http_port)):
        if not port:
            continue
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # a port in TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((config.host, port))
            except OSError as error:
                raise PortInUseError(
                    f"cannot serve {name} on {config.host}:{port}: {error.strerror} "
                    f"(--{'http-' if name == 'HTTP' else ''}port)"
                ) from None


async def start_system(config: ServeConfig) -> System:
    check_ports_free(config)
    init_ray(config)  # before anything imports ray: the loopback setting is read at import

    from engine.tokenizer import load_tokenizer
    from pdserve.workers import RayWorkerFactory
    from router.grpc_server import GenerationServicer, mark_serving, start_grpc_server
    from router.overload import AdmissionLimits
    from router.pools import AutoscaleLoop, PoolManager, WorkerPool
    from router.router import Router, RouterConfig
    from router.validation import ValidationLimits

    started = time.monotonic()
    tokenizer = load_tokenizer(config.tokenizer or config.model)
    if config.chat_template is not None:
        tokenizer.use_chat_template(config.chat_template_text)
    decode_role = "decode" if config.mode == "disaggregated" else "colocated"
    admission = AdmissionLimits(config.max_in_flight, config.max_waiting_for_kv)
    router = Router(
        RouterConfig(
            config.mode,
            kv_timeout_s=config.kv_timeout_s,
            limits=admission,
            stream_interval=config.stream_interval,
            pd=config.pd,
            routing=config.routing_config,
            slo=config.slo_target,
            prefill_order=config.prefill_order,
            kv_wire=config.kv_wire_config,
        ),
        tokenizer,
        WorkerPool("prefill"),
        WorkerPool(decode_role),
    )
    pools = PoolManager(router, RayWorkerFactory(config, epoch=int(time.time())))
    await asyncio.gather(
        pools.add_workers(decode_role, config.num_decode),
        pools.add_workers("prefill", config.num_prefill if config.mode == "disaggregated" else 0),
    )
    if config.transport == "rdt" and config.mode == "disaggregated":
        await pools.form_kv_group()
    # The context served is what every worker can hold: a prompt a worker cannot hold is refused at
    # once.
    infos = [
        worker.info for pool in (router.prefill_pool, router.decode_pool) for worker in pool.workers
    ]
    limits = ValidationLimits(
        max_context_tokens=min(info.max_context_tokens for info in infos),
        vocab_size=infos[0].vocab_size,
        model_context_tokens=infos[0].model_context_tokens,
    )
    system = System(config, router, None, 0, None, pools, limits)
    if config.otlp_endpoint is not None:
        from router.tracing import start_tracing

        system.tracer = start_tracing(config.otlp_endpoint)
    servicer = GenerationServicer(
        router, limits, system.stats, pools.scale, config.credentials, system.tracer
    )
    try:
        system.server, system.port, system.health = await start_grpc_server(
            servicer, config.host, config.port, config.tls, config.access_log
        )
        if config.http_port is not None:
            system.http_runner, system.http_port = await start_http(system, limits)
    except BaseException:  # a port taken since the check: stop what started, workers included
        await system.stop()
        raise
    pools.start_healing()
    if config.autoscale is not None:
        system.autoscaler = AutoscaleLoop(pools, config.autoscale)
        system.autoscaler.start()
    # What start-up allocated (tokenizer, Ray, gRPC, protobuf) lives as long as the process: frozen,
    # it is out of the collector's full passes (38 ms each with Ray and gRPC loaded, in the middle
    # of streams).
    gc.collect()
    gc.freeze()
    await mark_serving(system.health)
    system.ready = True
    log.info("%s in %.1f s", system.ready_line(), time.monotonic() - started)
    return system


async def start_http(system: System, limits):
    """The OpenAI-compatible HTTP server over this system's router; returns (runner, bound port)."""
    from router.http_server import HttpFrontend, start_http_server

    config = system.config
    frontend = HttpFrontend(
        system.router,
        limits,
        config.model_name,
        config.credentials,
        system.metrics_snapshot,
        system.pools.scale,
        lambda: system.ready,
        config.access_log,
        system.tracer,
    )
    return await start_http_server(
        frontend, config.host, config.http_port, _ssl_context(config.tls)
    )


def _ssl_context(tls: Optional[tuple[str, str]]):
    if tls is None:
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*tls)
    return context
