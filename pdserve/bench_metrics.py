"""`pdserve bench`'s figures: the per-request record, vLLM's serving metrics computed from records
(a pure function, testable without a server), the per-turn figures of the conversation dataset, and
the result tables as vLLM prints them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from pdserve.bench import BenchConfig

_METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
_MAX_ERRORS_SHOWN = 5


@dataclass
class RequestRecord:
    success: bool
    prompt_len: int
    output_len: int
    ttft_s: Optional[float]
    itls_s: list[float]
    e2el_s: float  # for a failed request: the time until it failed
    start_s: float  # from the start of the run
    error: str = ""
    # KV shipped from the prefill to the decode worker; None: the backend cannot know
    kv_bytes: Optional[int] = None
    cached_prompt_tokens: Optional[int] = None  # as the server reports them; None: it reports none
    # the prefill worker's engine step that prefilled the prompt, as the server timed it; None: it
    # reports none (the OpenAI APIs; a prompt prefilled on the worker that decodes it)
    server_prefill_s: Optional[float] = None
    # the decode worker's mean engine decode step while it decoded the request, as it timed them;
    # None: it reports none (the OpenAI APIs; a request that never decoded)
    server_decode_step_s: Optional[float] = None
    reply_text: str = ""  # the generated text as streamed: a conversation's next turn sends it back
    # 1-based turn within its conversation; None outside the conversation dataset
    turn: Optional[int] = None

    @property
    def tpot_s(self) -> Optional[float]:
        if self.ttft_s is None or self.output_len < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (50.0, 99.0),
    goodput_slos_ms: Optional[dict[str, float]] = None,
) -> dict:
    """vLLM's serving figures from per-request records. Failed requests count only in `failed` (and
    in the peak concurrency). TPOT is (e2el - ttft) / (output_len - 1) over requests with two or
    more output tokens; ITL pools every gap of every completed request. Goodput counts the completed
    requests meeting every given SLO (a request of one output token meets any TPOT SLO, as in
    vLLM)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    samples_s = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [gap for r in done for gap in r.itls_s],
        "e2el": [r.e2el_s for r in done],
    }
    total_input, total_output = sum(r.prompt_len for r in done), sum(r.output_len for r in done)
    result = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": _peak_concurrency(records),
        # the server's own prefill time (the grpc backend's timings), which pdserve's planner
        # compares with the client's TTFT; None: the server reports none
        "median_server_prefill_ms": _median_ms(
            [r.server_prefill_s for r in done if r.server_prefill_s is not None]
        ),
        # and its decode steps (the decode worker's mean engine step per request), beside TPOT
        "median_server_decode_step_ms": _median_ms(
            [r.server_decode_step_s for r in done if r.server_decode_step_s is not None]
        ),
    }
    if goodput_slos_ms:
        good = [
            r
            for r in done
            if all(_slo_value_ms(r, name) <= slo_ms for name, slo_ms in goodput_slos_ms.items())
        ]
        result["request_goodput"] = len(good) / duration_s
    for name, values_s in samples_s.items():
        result.update(_latency_stats_ms(name, values_s, percentiles))
    return result


def per_turn_metrics(
    records: Sequence[RequestRecord], percentiles: Sequence[float] = (50.0, 99.0)
) -> list[dict]:
    """The conversation dataset's figures per turn index (records without a turn are left out):
    requests completed and failed, and over the completed ones the mean prompt tokens, TTFT
    statistics, the mean KV bytes shipped and the mean cached prompt tokens, each mean over the
    requests that report the value (None when none does: the OpenAI backends never know KV
    bytes)."""
    per_turn = []
    for turn in sorted({r.turn for r in records if r.turn is not None}):
        sent = [r for r in records if r.turn == turn]
        done = [r for r in sent if r.success]
        per_turn.append(
            {
                "turn": turn,
                "completed": len(done),
                "failed": len(sent) - len(done),
                "mean_input_tokens": _mean([r.prompt_len for r in done]),
                **_latency_stats_ms("ttft", [r.ttft_s for r in done], percentiles),
                "mean_kv_bytes": _mean([r.kv_bytes for r in done if r.kv_bytes is not None]),
                "mean_cached_prompt_tokens": _mean(
                    [r.cached_prompt_tokens for r in done if r.cached_prompt_tokens is not None]
                ),
            }
        )
    return per_turn


def _median_ms(values_s: Sequence[float]) -> Optional[float]:
    return float(np.median(values_s)) * 1e3 if values_s else None


def _latency_stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    values_ms = np.asarray(values_s, dtype=float) * 1e3
    empty = values_ms.size == 0
    stats = {
        f"mean_{name}_ms": None if empty else float(values_ms.mean()),
        f"median_{name}_ms": None if empty else float(np.median(values_ms)),
        f"std_{name}_ms": None if empty else float(values_ms.std()),
    }
    for p in percentiles:
        stats[f"p{_percentile_name(p)}_{name}_ms"] = (
            None if empty else float(np.percentile(values_ms, p))
        )
    return stats


def _mean(values: Sequence[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def _slo_value_ms(record: RequestRecord, name: str) -> float:
    value_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}[name]
    return value_s * 1e3


def _peak_concurrency(records: Sequence[RequestRecord]) -> int:
    # Ends sort before starts at the same instant: a request that ends as another starts is not
    # overlap.
    events = sorted(
        [(r.start_s, 1) for r in records] + [(r.start_s + r.e2el_s, -1) for r in records]
    )
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _row(label: str, value) -> str:
    if value is None:
        return f"{label:<40} {'n/a':<10}"
    return (
        f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value!s:<10}"
    )


def format_result(result: dict, config: BenchConfig) -> str:
    """One rate's result as vLLM prints it."""
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Backend:", config.backend),
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
        _row("Request rate configured (RPS):", result["request_rate"]),
        _row("Burstiness factor:", result["burstiness"]),
        _row("Maximum request concurrency:", result["max_concurrency"]),
        _row("Benchmark duration (s):", result["duration_s"]),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", result["output_throughput"]),
        _row("Peak concurrent requests:", result["max_concurrent_requests"]),
        _row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name in config.percentile_metrics:
        title, short = _METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in config.metric_percentiles:
            lines.append(
                _row(
                    f"P{_percentile_name(p)} {short} (ms):",
                    result[f"p{_percentile_name(p)}_{name}_ms"],
                )
            )
    if result.get("per_turn"):
        lines += _per_turn_table(result["per_turn"])
    if result["distinct_errors"]:
        lines.append("{s:{c}^{n}}".format(s="Errors (first distinct)", n=50, c="-"))
        lines += [f"  {error}" for error in result["distinct_errors"][:_MAX_ERRORS_SHOWN]]
    lines.append("=" * 50)
    return "\n".join(lines)


def _per_turn_table(per_turn: Sequence[dict]) -> list[str]:
    lines = [
        "{s:{c}^{n}}".format(s="Per turn of the conversations", n=50, c="-"),
        f"{'turn':>4} {'done':>5} {'in tok':>7} {'TTFT p50/p99 ms':>16} {'KV MiB':>7} "
        f"{'cached':>6}",
    ]
    for t in per_turn:
        kv_mib = None if t["mean_kv_bytes"] is None else t["mean_kv_bytes"] / 2**20
        lines.append(
            f"{t['turn']:>4} {t['completed']:>5} {_fixed(t['mean_input_tokens'], 0):>7} "
            f"{_fixed(t['p50_ttft_ms'], 1) + '/' + _fixed(t['p99_ttft_ms'], 1):>16} "
            f"{_fixed(kv_mib, 2):>7} {_fixed(t['mean_cached_prompt_tokens'], 0):>6}"
        )
    lines.append("(in tok, KV MiB and cached: means per completed request; n/a: not reported)")
    return lines


def _fixed(value: Optional[float], decimals: int) -> str:
    return "n/a" if value is None else f"{value:.{decimals}f}"


def format_sweep(report: dict) -> str:
    def ms(value) -> str:
        return _fixed(value, 1)

    lines = [
        f"{'rate':>8} {'done':>5} {'fail':>5} {'req/s':>7} {'good/s':>7} {'out tok/s':>9} "
        f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} {'ITL p50/p99 ms':>17}"
    ]
    for r in report["results"]:
        goodput = "n/a" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
        lines.append(
            f"{r['request_rate']:>8g} {r['completed']:>5} {r['failed']:>5} "
            f"{r['request_throughput']:>7.2f} {goodput:>7} {r['output_throughput']:>9.1f} "
            + " ".join(
                f"{ms(r[f'p50_{m}_ms']) + '/' + ms(r[f'p99_{m}_ms']):>17}"
                for m in ("ttft", "tpot", "itl")
            )
        )
    return "\n".join(lines)
