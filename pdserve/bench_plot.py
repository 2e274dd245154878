"""The `pdserve bench --plot` figure: latency percentiles and throughput against request rate.

Rates sit at evenly spaced positions labelled with their value (sweeps are usually geometric, and
`inf` has no place on a numeric axis); one rate gives one point per series, still labelled.
"""

from __future__ import annotations

import math


def _rate_label(rate: float) -> str:
    return "inf\n(all at once)" if math.isinf(rate) else f"{rate:g}"


def plot_report(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    results = report["results"]
    positions = list(range(len(results)))
    labels = [_rate_label(r["request_rate"]) for r in results]
    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    latency_panels = [("ttft", "Time to first token"), ("tpot", "Time per output token"), ("itl", "Inter-token latency")]
    for ax, (metric, title) in zip(axes.flat, latency_panels):
        for p, style in (("50", "o-"), ("99", "s--")):
            values = [r[f"p{p}_{metric}_ms"] for r in results]
            ax.plot(positions, [math.nan if v is None else v for v in values], style, label=f"p{p}")
        ax.set_title(f"{title} ({metric.upper()})")
        ax.set_ylabel("milliseconds")
        ax.set_ylim(bottom=0)
    throughput = axes.flat[3]
    throughput.plot(positions, [r["request_throughput"] for r in results], "o-", label="request throughput")
    if any(r["request_goodput"] is not None for r in results):
        throughput.plot(positions, [math.nan if r["request_goodput"] is None else r["request_goodput"] for r in results],
                        "s--", label="goodput (met every SLO)")
    throughput.set_ylabel("requests / s")
    throughput.set_ylim(bottom=0)
    tokens = throughput.twinx()
    tokens.plot(positions, [r["output_throughput"] for r in results], "^:", color="tab:green", label="output tokens / s")
    tokens.set_ylabel("output tokens / s")
    tokens.set_ylim(bottom=0)
    throughput.set_title("Throughput and goodput")
    handles = throughput.get_legend_handles_labels()[0] + tokens.get_legend_handles_labels()[0]
    throughput.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize="small")
    for ax in axes.flat:
        ax.set_xticks(positions, labels)
        ax.set_xlim(-0.5, len(results) - 0.5)
        ax.set_xlabel("request rate (requests / s)")
        ax.grid(alpha=0.3)
        if ax is not throughput:
            ax.legend(fontsize="small")
    config = report["config"]
    figure.suptitle(f"pdserve bench: {report['backend']} backend, model {report['model']}, {config['num_prompts']} prompts, "
                    f"input {config['random_input_len']} / output {config['random_output_len']} tokens"
                    + (f", max concurrency {config['max_concurrency']}" if config["max_concurrency"] else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
