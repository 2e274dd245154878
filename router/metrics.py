"""The router's Prometheus metrics (prometheus_client), served at `GET /metrics`.

Histograms and counters are fed by the router as requests stream and finish. Gauges of pools,
queues, KV-cache use and GPU telemetry come from a snapshot of the workers' loads taken when
/metrics is scraped (`set_snapshot`), so a scrape always shows current values and costs nothing
between scrapes. Each system has its own registry: two systems in one process (tests) never share
series.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable, Optional

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from protocol.messages import WorkerCosts, WorkerLoad
from router.slo import RESULTS, SLO

LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(16, 34, 1))  # 64 KiB .. 8 GiB
OUTCOMES = ("stop", "length", "aborted", "error", "rejected", "invalid", "unauthorized")
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    role: str
    state: str
    load: Optional[WorkerLoad]  # None when the worker did not answer
    costs: WorkerCosts = WorkerCosts()  # as the router last heard them (the PD policy's input)


@dataclass
class Snapshot:
    workers: list[WorkerRow] = field(default_factory=list)
    requests_running: int = 0
    requests_waiting_for_kv: int = 0
    # (sender node, receiver node) -> router.links.LinkEstimate: what KV handoffs cost there
    links: dict = field(default_factory=dict)
    # pool -> why it serves degraded (router/pools/manager.py PoolManager.degraded)
    degraded: dict = field(default_factory=dict)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, text: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, text, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "pdserve_time_to_first_token_seconds", "Request received to first token sent"
        )
        self.tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds",
            "Gap between consecutive streamed messages of a request",
        )
        self.e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Request received to last token sent"
        )
        self.queue = histogram(
            "pdserve_request_queue_time_seconds", "Request received to prefill started"
        )
        self.kv_transfer = histogram(
            "pdserve_kv_transfer_seconds",
            "KV handoff started on the prefill worker to KV ready on the decode worker",
        )
        self.kv_bytes = histogram(
            "pdserve_kv_transfer_bytes", "KV bytes moved per request", BYTES_BUCKETS
        )
        self.requests = Counter(
            "pdserve_requests",
            "Requests by outcome: finish reason, aborted by the client, "
            "error, rejected (overload), invalid, unauthorized",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            # every series exists from the start (rate() needs a zero)
            self.requests.labels(outcome)
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.migrations = Counter(
            "pdserve_migrations",
            "Requests re-run on healthy workers after a worker died under them",
            registry=self.registry,
        )
        self.pd_decisions = Counter(
            "pdserve_pd_decision",
            "Where disaggregated requests were prefilled: path "
            "remote (the prefill pool) or local (their decode worker), and why "
            "(router/pd_policy.py)",
            ["path", "reason"],
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            "pdserve_routing_decision",
            "Which worker of a pool requests went to: reason prefix_hit (it held a "
            "prefix of the prompt), no_hit, or load (--routing load) (router/kv_index.py)",
            ["pool", "reason"],
            registry=self.registry,
        )
        self.prefix_hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens",
            "Prompt tokens found in a worker's KV cache: not computed (prefill pool, and local "
            "prefills on the decode pool) or not shipped (the decode pool's reused blocks)",
            ["pool"],
            registry=self.registry,
        )
        self.kv_wire = Counter(
            "pdserve_kv_wire",
            "Disaggregated handoffs by the wire mode their KV went in (none, lossless, fp8, int8) "
            "and why: asked (--kv-wire), or auto's faster, no_gain, no_link (router/kv_wire.py)",
            ["mode", "reason"],
            registry=self.registry,
        )
        self.kv_wire_bytes = Counter(
            "pdserve_kv_wire_bytes",
            "KV of handoffs, by kind: raw (the cache's own size) or wire (what was sent)",
            ["kind"],
            registry=self.registry,
        )
        self.kv_bytes_reused = Counter(
            "pdserve_kv_reused_bytes",
            "KV bytes not shipped to decode workers because they held those blocks already",
            registry=self.registry,
        )
        # The SLO (router/slo.py): attainment = met / all results; rate(goodput) = vLLM's request
        # goodput.
        self.slo_requests = Counter(
            "pdserve_slo_requests",
            "Completed requests (finish reason stop or length) by how they fared against "
            "the SLO (--slo): met, ttft_missed, tpot_missed, both_missed",
            ["result"],
            registry=self.registry,
        )
        for result in RESULTS:
            self.slo_requests.labels(result)
        self.slo_goodput = Counter(
            "pdserve_slo_goodput_requests",
            "Completed requests that met both SLO targets "
            "(rate(): goodput, as vLLM's --goodput counts it)",
            registry=self.registry,
        )
        self.slo_ttft_target = Gauge(
            "pdserve_slo_ttft_target_seconds",
            "The SLO's time-to-first-token target",
            registry=self.registry,
        )
        self.slo_tpot_target = Gauge(
            "pdserve_slo_tpot_target_seconds",
            "The SLO's time-per-output-token target",
            registry=self.registry,
        )
        self.snapshot = Snapshot()
        self.registry.register(_PoolCollector(self))

    def observe_finished(self, final) -> None:
        """A request finished normally: its latencies, transfer and token counts (`final`:
        router.FinalInfo)."""
        self.requests.labels(
            {"abort": "aborted"}.get(final.finish_reason, final.finish_reason)
        ).inc()
        self.ttft.observe(final.ttft_s)
        if final.completion_tokens > 1:
            self.tpot.observe(final.tpot_s)
        self.e2e.observe(final.e2e_s)
        self.queue.observe(final.queue_s)
        if final.kv_bytes:
            self.kv_transfer.observe(final.kv_transfer_s)
            self.kv_bytes.observe(final.kv_bytes)
        self.prompt_tokens.inc(final.prompt_tokens)

    def set_slo(self, slo: SLO) -> None:
        """The targets the router judges requests against (shown as gauges)."""
        self.slo_ttft_target.set(slo.ttft_s)
        self.slo_tpot_target.set(slo.tpot_s)

    def observe_slo(self, result: str) -> None:
        """A completed request's outcome against the SLO: one of router.slo.RESULTS."""
        self.slo_requests.labels(result).inc()
        if result == "met":
            self.slo_goodput.inc()

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """Gauges from the last snapshot of the pools (a custom collector: labels come and go with
    workers)."""

    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def describe(self) -> Iterable:
        return []  # unchecked collector: its series depend on the workers present at scrape time

    def collect(self) -> Iterable[GaugeMetricFamily]:
        snap = self.metrics.snapshot
        workers = GaugeMetricFamily(
            "pdserve_workers", "Workers by role and state", labels=["role", "state"]
        )
        for (role, state), count in sorted(
            collections.Counter((w.role, w.state) for w in snap.workers).items()
        ):
            workers.add_metric([role, state], count)
        yield workers
        yield GaugeMetricFamily(
            "pdserve_requests_running",
            "Requests in flight on the router",
            value=snap.requests_running,
        )
        yield GaugeMetricFamily(
            "pdserve_requests_waiting_for_kv",
            "Requests waiting for KV room on a decode worker",
            value=snap.requests_waiting_for_kv,
        )
        per_worker = {
            name: GaugeMetricFamily(f"pdserve_worker_{name}", text, labels=["worker", "role"])
            for name, text in (
                ("running_requests", "Requests running on the worker"),
                ("waiting_requests", "Requests queued on the worker"),
                ("kv_blocks_free", "Free KV-cache blocks"),
                ("kv_blocks_total", "KV-cache blocks"),
                ("kv_cache_usage_ratio", "Fraction of KV-cache blocks in use"),
                ("rss_bytes", "Resident memory of the worker process"),
                ("decode_steps", "Engine steps that only decoded (no prompt tokens), since start"),
                ("decode_step_seconds", "Time of those steps, since start"),
                (
                    "borrowed_core_steps",
                    "Engine steps the worker ran on cores borrowed from idle workers of its node, "
                    "since start",
                ),
                (
                    "lent_core_wait_seconds",
                    "Time the worker waited for its lent cores to come back, since start",
                ),
                (
                    "lent_core_pauses",
                    "Decode pauses that lent the worker's cores to a prefill within its TPOT "
                    "slack, since start",
                ),
                ("lent_core_pause_seconds", "Time of those pauses, since start"),
                (
                    "gpu_available",
                    "1 if the worker sees a GPU through NVML, else 0 (see pdserve_worker_gpu_info)",
                ),
                (
                    "prefill_token_seconds",
                    "Its recent prefill steps' seconds per prompt token, as the router last heard "
                    "(the PD policy's input)",
                ),
                (
                    "decode_slack_seconds",
                    "How long its decoding streams could wait for a prompt within the TPOT target, "
                    "as the router last heard (+Inf: none decoding; the PD policy's input)",
                ),
            )
        }
        gpu_info = GaugeMetricFamily(
            "pdserve_worker_gpu_info",
            "Per worker: its GPU, or why it has none",
            labels=["worker", "gpu", "name", "note"],
        )
        gpu_memory = GaugeMetricFamily(
            "pdserve_gpu_memory_used_bytes", "GPU memory in use", labels=["worker", "gpu"]
        )
        gpu_memory_total = GaugeMetricFamily(
            "pdserve_gpu_memory_total_bytes", "GPU memory", labels=["worker", "gpu"]
        )
        gpu_util = GaugeMetricFamily(
            "pdserve_gpu_utilization_ratio", "GPU utilisation (NVML)", labels=["worker", "gpu"]
        )
        kernel_info = GaugeMetricFamily(
            "pdserve_worker_kernel_info",
            "Per worker and op: the native kernel it runs (engine/kernels.py), or the fallback "
            "where none passed its self-check or one failed",
            labels=["worker", "op", "kernel"],
        )
        for row in snap.workers:
            load, labels = row.load, [row.worker_id, row.role]
            if load is None:
                continue
            for op, kernel in load.kernels:
                kernel_info.add_metric([row.worker_id, op, kernel], 1)
            values = {
                "running_requests": load.running_requests,
                "waiting_requests": load.waiting_requests,
                "kv_blocks_free": load.kv_blocks_free,
                "kv_blocks_total": load.kv_blocks_total,
                "kv_cache_usage_ratio": 1 - load.kv_blocks_free / load.kv_blocks_total
                if load.kv_blocks_total
                else 0.0,
                "rss_bytes": load.rss_bytes,
                "decode_steps": load.decode_steps,
                "decode_step_seconds": load.decode_steps_s,
                "borrowed_core_steps": load.borrowed_core_steps,
                "lent_core_wait_seconds": load.lent_core_wait_s,
                "lent_core_pauses": load.lent_pauses,
                "lent_core_pause_seconds": load.lent_pauses_s,
                "gpu_available": 1.0 if load.gpus else 0.0,
                "decode_slack_seconds": row.costs.decode_slack_s,
            }
            if row.costs.prefill_token_s is not None:
                values["prefill_token_seconds"] = row.costs.prefill_token_s
            for name, value in values.items():
                per_worker[name].add_metric(labels, value)
            if not load.gpus:
                gpu_info.add_metric([row.worker_id, "", "", load.gpu_note or "no GPU"], 1)
            for gpu in load.gpus:
                index = str(gpu.index)
                gpu_info.add_metric([row.worker_id, index, gpu.name, ""], 1)
                gpu_memory.add_metric([row.worker_id, index], gpu.memory_used_bytes)
                gpu_memory_total.add_metric([row.worker_id, index], gpu.memory_total_bytes)
                gpu_util.add_metric([row.worker_id, index], gpu.utilization)
        yield from per_worker.values()
        yield from (gpu_info, gpu_memory, gpu_memory_total, gpu_util, kernel_info)
        yield from _link_families(snap.links)
        degraded = GaugeMetricFamily(
            "pdserve_degraded",
            "1 while the pool serves degraded: no live node of its type, or no ready worker "
            "(the other pool's workers do its work)",
            labels=["pool"],
        )
        for pool in sorted({row.role for row in snap.workers} | set(snap.degraded)):
            degraded.add_metric([pool], 1.0 if pool in snap.degraded else 0.0)
        yield degraded


def _link_families(links: dict) -> Iterable[GaugeMetricFamily]:
    """Per link a KV handoff crossed (router/links.py), from the handoffs themselves."""
    labels = ["sender_node", "receiver_node"]
    families = {
        "latency_seconds": GaugeMetricFamily(
            "pdserve_link_latency_seconds",
            "A KV handoff's fixed cost on the link, fitted to its latest handoffs",
            labels=labels,
        ),
        "bandwidth": GaugeMetricFamily(
            "pdserve_link_bandwidth_bytes_per_second",
            "KV bytes per second a handoff moves on the link, fitted to its latest handoffs "
            "(+Inf: too few large ones yet)",
            labels=labels,
        ),
        "handoffs": GaugeMetricFamily(
            "pdserve_link_handoffs", "KV handoffs seen on the link since start", labels=labels
        ),
    }
    for (sender, receiver), estimate in sorted(links.items()):
        families["latency_seconds"].add_metric([sender, receiver], estimate.latency_s)
        families["bandwidth"].add_metric([sender, receiver], estimate.bandwidth_bytes_per_s)
        families["handoffs"].add_metric([sender, receiver], estimate.handoffs)
    yield from families.values()
