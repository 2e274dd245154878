"""The `pdserve bench --plot` figure: latency percentiles and throughput against request rate.

Rates sit at evenly spaced positions labelled with their value (sweeps are usually geometric, and
`inf` has no place on a numeric axis). With a single rate every point carries its value, so the
figure still reads as a small table.
"""

from __future__ import annotations

import math

# (title, y unit, [(result key, label), ...]): the first series solid with circles, the second
# dashed with squares.
_PANELS = [
    *[
        (title, "milliseconds", [(f"p50_{metric}_ms", "p50"), (f"p99_{metric}_ms", "p99")])
        for metric, title in (
            ("ttft", "Time to first token (TTFT)"),
            ("tpot", "Time per output token (TPOT)"),
            ("itl", "Inter-token latency (ITL)"),
            ("e2el", "End-to-end latency (E2EL)"),
        )
    ],
    (
        "Request throughput",
        "requests / s",
        [("request_throughput", "completed"), ("request_goodput", "goodput (met every SLO)")],
    ),
    (
        "Token throughput",
        "tokens / s",
        [
            ("output_throughput", "output tokens"),
            ("total_token_throughput", "input + output tokens"),
        ],
    ),
]


def _rate_label(rate: float) -> str:
    return "inf\n(all at once)" if math.isinf(rate) else f"{rate:g}"


def plot_report(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    results = report["results"]
    # its rate starts users, not requests
    conversation = report["config"].get("dataset") == "conversation"
    positions = list(range(len(results)))
    figure, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (title, unit, series) in zip(axes.flat, _PANELS):
        shown = []
        for (key, label), style, label_dy in zip(series, ("o-", "s--"), (-11, 3)):
            ys = [math.nan if r[key] is None else r[key] for r in results]
            if all(math.isnan(y) for y in ys):
                continue  # e.g. goodput without SLOs
            ax.plot(positions, ys, style, label=label, markersize=7)
            shown += [y for y in ys if not math.isnan(y)]
            if len(results) == 1:  # the lower series' value below its point, the upper one's above
                ax.annotate(
                    f"{ys[0]:,.0f}" if ys[0] >= 100 else f"{ys[0]:.3g}",
                    (0, ys[0]),
                    textcoords="offset points",
                    xytext=(10, label_dy),
                    fontsize="small",
                )
        ax.set_title(title)
        ax.set_ylabel(unit)
        # from zero, room above the top point
        ax.set_ylim(0, 1.15 * max(shown) if shown and max(shown) > 0 else 1)
        ax.set_xticks(positions, [_rate_label(r["request_rate"]) for r in results])
        ax.set_xlim(-0.5, len(results) - 0.5)
        ax.set_xlabel("users started / s" if conversation else "request rate (requests / s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    config = report["config"]
    if conversation:
        workload = (
            f"{config['users']} users x {config['turns']} turns, system "
            f"{config['system_prompt_len']} / "
            f"turn {config['turn_input_len']} / output {config['random_output_len']} tokens"
        )
    else:
        workload = (
            f"{config['num_prompts']} prompts per rate, input {config['random_input_len']} / "
            f"output {config['random_output_len']} tokens"
        )
    figure.suptitle(
        f"pdserve bench: {report['backend']} backend, model {report['model']}, {workload}"
        + (f", max concurrency {config['max_concurrency']}" if config["max_concurrency"] else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
