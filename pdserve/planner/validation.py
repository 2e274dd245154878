"""The simulator against real runs: `pdserve bench` results beside `simulate` on the same arrivals.

    python -m pdserve.planner.validation PROFILE RUNS NAME=SHAPE ... [--slo ttft:1000,tpot:50]

RUNS is a folder of benchmarks/results/planner/validate.sh: NAME.json (a sweep of the random
dataset) and NAME-conversation.json (the conversation dataset) per system. Each rate of a sweep is
simulated on the arrivals the client drew for it (`arrival=bench`, seed = the run's seed + the
rate's index), with the run's lengths; a row is predicted / measured (miss). Prints a Markdown
table; --json the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from pdserve.planner.profile import Profile
from pdserve.planner.shape import SystemShape
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import Workload
from router.slo import SLO


def rows(profile: Profile, runs: Path, systems: dict[str, str], slo: SLO) -> list[dict]:
    result = []
    for name, shape_text in systems.items():
        shape = SystemShape.parse(shape_text)
        sweep = runs / f"{name}.json"
        if sweep.exists():
            data = json.loads(sweep.read_text())
            config = data["config"]
            for index, measured in enumerate(data["results"]):
                workload = Workload(
                    input_tokens=(config["random_input_len"],) * 2,
                    output_tokens=(config["random_output_len"],) * 2,
                    num_requests=config["num_prompts"],
                    arrival="bench",
                    seed=config["seed"] + index,
                )
                result.append(
                    _row(name, shape, "random", measured, profile, slo, workload, measured)
                )
        chats = runs / f"{name}-conversation.json"
        if chats.exists():
            data = json.loads(chats.read_text())
            config = data["config"]
            measured = data["results"][0]
            workload = Workload(
                output_tokens=(config["random_output_len"],) * 2,
                arrival="bench",
                seed=config["seed"],
                users=config["users"],
                turns=config["turns"],
                system_tokens=config["system_prompt_len"],
                turn_tokens=config["turn_input_len"],
                think_s=config["think_time_s"],
            )
            result.append(
                _row(name, shape, "conversation", measured, profile, slo, workload, measured)
            )
    return result


def _row(name, shape, dataset, measured, profile, slo, workload, run) -> dict:
    rate = run["request_rate"]
    report = simulate(profile, shape, slo, workload.requests(rate))
    return {
        "system": name,
        "shape": str(shape),
        "dataset": dataset,
        "rate": rate,
        "predicted": {
            "ttft_p50_ms": report.ttft_ms["p50"],
            "ttft_p90_ms": report.ttft_ms["p90"],
            "tpot_p50_ms": report.tpot_ms["p50"],
            "goodput_rps": report.goodput_rps,
        },
        "measured": {
            "ttft_p50_ms": measured["p50_ttft_ms"],
            "ttft_p90_ms": measured.get("p90_ttft_ms"),
            "tpot_p50_ms": measured["p50_tpot_ms"],
            "goodput_rps": _goodput(measured, slo),
        },
    }


def _goodput(measured: dict, slo: SLO) -> Optional[float]:
    """The run's goodput under `slo`: the client's own when it was given that SLO, else counted from
    its per-request records."""
    if measured.get("request_goodput") is not None:
        return measured["request_goodput"]
    records = measured.get("requests") or []
    if not records:
        return None
    met = sum(
        1
        for r in records
        if r["success"]
        and slo.met(
            r["ttft_s"],
            (r["e2el_s"] - r["ttft_s"]) / (r["output_len"] - 1) if r["output_len"] > 1 else None,
        )
    )
    return met / measured["duration_s"]


def markdown(table: list[dict]) -> str:
    lines = [
        "| system | dataset | rate | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | goodput req/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table:
        p, m = row["predicted"], row["measured"]
        cells = [_relative(p[key], m[key]) for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms")]
        cells.append(_absolute(p["goodput_rps"], m["goodput_rps"]))
        lines.append(
            f"| {row['system']} ({row['shape']}) | {row['dataset']} | {row['rate']:g} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _relative(predicted: float, measured: Optional[float]) -> str:
    if measured is None:
        return f"{predicted:.0f} / ?"
    miss = (predicted - measured) / measured
    flag = "" if abs(miss) <= 0.2 else " **miss**"
    return f"{predicted:.0f} / {measured:.0f} ({miss:+.0%}){flag}"


def _absolute(predicted: float, measured: Optional[float]) -> str:
    if measured is None:
        return f"{predicted:.2f} / ?"
    miss = predicted - measured
    flag = "" if abs(miss) <= 0.1 + 1e-9 else " **miss**"
    return f"{predicted:.2f} / {measured:.2f} ({miss:+.2f}){flag}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.planner.validation")
    parser.add_argument("profile")
    parser.add_argument("runs")
    parser.add_argument("systems", nargs="+", metavar="NAME=SHAPE", help="e.g. 1p1d=1p1d@0.5")
    parser.add_argument("--slo", default="ttft:1000,tpot:50")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    systems = dict(item.split("=", 1) for item in args.systems)
    table = rows(Profile.load(args.profile), Path(args.runs), systems, SLO.parse(args.slo))
    print(json.dumps(table, indent=1) if args.json else markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
