"""What a simulated run predicts: latency percentiles, goodput under the SLO, utilisation per pool.

Counted as `pdserve bench` and vLLM's client count them (router/slo.py): TTFT from arrival to the
first token; TPOT over the tokens after the first; ITL every gap between two tokens of a stream;
goodput the completed requests that met the SLO per second of the run (first arrival at 0 to the
last token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Report:
    shape: str
    requests: int
    duration_s: float
    ttft_ms: dict  # "p50", "p90", "p99", "mean"
    tpot_ms: dict
    itl_ms: dict
    goodput_rps: float
    slo_attainment: float  # share of the requests that met the SLO
    throughput_tokens_s: float
    # pool -> busy share of its workers' time; "router": its CPU share of one core
    utilisation: dict
    mean_queue_ms: float  # arrival to the start of its prefill (remote or local), on average

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        rows = [
            f"{self.shape}: {self.requests} requests in {self.duration_s:.1f} s, goodput "
            f"{self.goodput_rps:.2f} req/s ({self.slo_attainment:.0%} within SLO), "
            f"{self.throughput_tokens_s:.0f} output tok/s",
            f"  {'metric':6} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}  (ms)",
        ]
        for name, values in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("ITL", self.itl_ms)):
            rows.append(
                f"  {name:6} "
                + " ".join(
                    f"{values.get(k, float('nan')):9.1f}" for k in ("p50", "p90", "p99", "mean")
                )
            )
        rows.append(
            "  utilisation: "
            + ", ".join(f"{pool} {share:.0%}" for pool, share in self.utilisation.items())
        )
        return "\n".join(rows)


def percentiles(values: Sequence[float]) -> dict:
    """p50/p90/p99 (linear between ranks, as numpy's default) and the mean, in ms; empty: {}."""
    if not values:
        return {}
    ordered = sorted(values)
    result = {}
    for q in PERCENTILES:
        position = (len(ordered) - 1) * q / 100
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        result[f"p{q}"] = 1e3 * (ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    result["mean"] = 1e3 * sum(ordered) / len(ordered)
    return result


def summarize(streams, simulation) -> Report:
    ttfts, tpots, itls, met = [], [], [], 0
    for stream in streams:
        times = stream.token_times_s
        ttft = times[0] - stream.arrival_s
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
        itls += [b - a for a, b in zip(times, times[1:])]
        met += simulation.slo.met(ttft, tpot)
    end_s = max(stream.token_times_s[-1] for stream in streams)
    tokens = sum(len(stream.token_times_s) for stream in streams)
    utilisation = {}
    for pool, workers in (
        ("prefill", simulation.prefill),
        (simulation.decode[0].role, simulation.decode),
    ):
        if workers:
            utilisation[pool] = sum(w.busy_s for w in workers) / (len(workers) * end_s)
    utilisation["router"] = tokens * simulation.profile.router_cpu_s_per_token / end_s
    queue = [stream.queue_s for stream in streams if getattr(stream, "queue_s", None) is not None]
    return Report(
        shape=str(simulation.shape),
        requests=len(streams),
        duration_s=end_s,
        ttft_ms=percentiles(ttfts),
        tpot_ms=percentiles(tpots),
        itl_ms=percentiles(itls),
        goodput_rps=met / end_s,
        slo_attainment=met / len(streams),
        throughput_tokens_s=tokens / end_s,
        utilisation=utilisation,
        mean_queue_ms=1e3 * sum(queue) / len(queue) if queue else 0.0,
    )
