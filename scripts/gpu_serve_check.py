"""The serving check of issue #32: the whole system (router, prefill and decode workers on Ray, the
KV handoff) on one GPU, driven by `pdserve bench`, disaggregated against colocated in one run.

    python3 scripts/gpu_serve_check.py --device cuda
        # the device machine (see below)
    .venv/bin/python scripts/gpu_serve_check.py --device cpu --quick
        # the same path in seconds (CI)

For each model section (`8b`: the Llama-3-8B shape with random weights in bf16, 1024 -> 128 tokens,
its KV host-staged (PDSERVE_KV_CUDA_IPC=0); `8b_ipc`, cuda only: the same, disaggregated, its KV
handed off through CUDA IPC on the one GPU (kvtransfer/cuda_ipc.py, the default there);
`default`: the default model in fp32, whose greedy tokens through the system must equal the
single-process engine's) it starts 1 prefill + 1 decode
worker through pdserve.system.start_system (pd_policy remote, so every request hands its KV off),
then colocated x2; warms each up, then runs `pdserve bench` (a subprocess, gRPC; gpu_serve_bench.py)
at three request rates. Per rate: TTFT / TPOT / ITL percentiles, output tok/s, goodput (TTFT <= 500
ms, TPOT <= 50 ms) and, from each request's final timings, the KV handoff (bytes, ms, share of its
TTFT). Writes serve_check_<device>_<sections>.json and .md to --out-dir (benchmarks/results/gpu) and
prints the figures against the targets: TTFT p50 < 500 ms at 1k-token prompts under load, TPOT p50
< 50 ms, >= 1000 output tok/s, KV handoff <= 5 % of TTFT.

One GPU, two workers: pdserve.workers asks Ray for one GPU per worker on cuda, so this script starts
Ray itself with 2 logical GPUs on the one card and RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1
(both workers see physical GPU 0), and gives each worker a fixed KV size (the plan's): two engines
must not each size their cache from the free memory. A dummy model has no tokenizer, which
start_system needs for the router: `--tokenizer default` serves (ids past its vocabulary decode to
nothing).

## On the device machine (one H200; no Ray there, nothing reachable)
Here, once: `flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/gpu_wheels.py build` (parts of
<= 40 MiB in .gpu_wheels/; part 1 alone serves the 8B shape). Then one `run` call (~5 device
minutes with the machine's start; 2026-12-04: 8b 147 s, 8b_ipc 71 s, kv_handoff 15 s), carry
[".gpu_wheels/part-1", "pdserve_proto"], timeout_s 560:

    python3 scripts/gpu_wheels.py stage 1 && python3 scripts/gpu_wheels.py install &&
    . /tmp/pdserve-gpu/env.sh && export PDSERVE_GPU_INSTALLED=1 PYTHONUNBUFFERED=1 &&
    python3 scripts/gpu_serve_check.py --device cuda --sections 8b --out-dir $OUT &&
    python3 scripts/gpu_serve_check.py --device cuda --sections 8b_ipc --out-dir $OUT &&
    python3 scripts/gpu_check.py --device cuda --sections kv_handoff --out $OUT/h200_kv_handoff.json

The `default` section needs the whole model: stage parts 2-4 in calls of their own first (a machine
stays warm 30 s after a call, and keeps what was staged). Copy what comes back into
benchmarks/results/gpu/. Each section runs on a Ray node of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = {"ttft_p50_ms": 500.0, "tpot_p50_ms": 50.0, "output_tok_s": 1000.0, "kv_share": 0.05}
GOODPUT_SLOS = ("ttft:500", "tpot:50")


@dataclass(frozen=True)
class Plan:
    """One model section: what is served and how hard it is driven."""

    name: str
    model: str
    dtype: str
    input_tokens: int
    output_tokens: int
    rates: tuple[float, ...]  # requests/s, in turn
    prompts_per_rate: int
    warmup_prompts: int
    kv_cache_bytes: int
    max_num_batched_tokens: int
    greedy_prompts: int  # chat prompts compared with the single-process engine (fp32 only)
    greedy_tokens: int
    modes: tuple[str, ...] = ("disaggregated", "colocated")
    # the KV by CUDA IPC on the one GPU (kvtransfer/cuda_ipc.py), else host-staged
    # (PDSERVE_KV_CUDA_IPC=0 for the workers)
    cuda_ipc: bool = False


GIB = 1 << 30
FULL = {
    "8b": Plan(
        "8b", "dummy:llama-3-8b", "bfloat16", 1024, 128, (4, 12, 24), 120, 32, 16 * GIB, 8192, 0, 0
    ),
    # the same, the KV handed off through CUDA IPC on the one GPU instead of host staging
    "8b_ipc": Plan(
        "8b_ipc",
        "dummy:llama-3-8b",
        "bfloat16",
        1024,
        128,
        (4, 12, 24),
        120,
        32,
        16 * GIB,
        8192,
        0,
        0,
        ("disaggregated",),
        True,
    ),
    "default": Plan(
        "default", "default", "float32", 1024, 128, (4, 12, 24), 96, 32, 4 * GIB, 8192, 6, 48
    ),
}
QUICK = {
    # the 8B section's stand-in: random weights of a shape whose vocabulary the tokenizer covers
    "8b": Plan("8b", "dummy:smollm2-135m", "float32", 24, 4, (2, 8), 2, 2, 32 << 20, 512, 0, 0),
    "default": Plan("default", "default", "float32", 24, 4, (2, 8), 2, 2, 32 << 20, 512, 2, 8),
}
# (prefill workers, decode workers) of each mode
WORKERS = {"disaggregated": (1, 1), "colocated": (0, 2)}


# -- what the device image lacks -------------------------------------------------------------------


def ensure_installed() -> None:
    """Ray and gguf, from the carried parts (scripts/gpu_wheels.py), then this script again."""
    try:
        import gguf  # noqa: F401
        import ray  # noqa: F401
    except ImportError as missing:
        if os.environ.get("PDSERVE_GPU_INSTALLED"):
            raise SystemExit(f"still missing after installing the carried parts: {missing}")
        print(f"{missing}: installing the carried parts", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts/gpu_wheels.py"), "install"], check=True)
        from gpu_wheels import DEVICE_DIR, default_model_file

        env = dict(os.environ, PDSERVE_GPU_INSTALLED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(DEVICE_DIR / "site"), env.get("PYTHONPATH")) if p
        )
        env["PDSERVE_DEFAULT_MODEL"] = str(default_model_file())
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


# -- one system, driven ----------------------------------------------------------------------------


def init_ray(device: str, object_store_bytes: int, cuda_ipc: bool) -> None:
    """A local Ray node as pdserve.system.init_ray starts one, plus (cuda) two logical GPUs on one
    card. Its workers inherit this process's environment: without `cuda_ipc`,
    PDSERVE_KV_CUDA_IPC=0 there (the KV host-staged)."""
    from kvtransfer.cuda_ipc import ENV

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every server on loopback
    os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
    os.environ[ENV] = "1" if cuda_ipc else "0"
    gpus = None
    if device == "cuda":
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # both see the one card
        gpus = 2
    import ray

    from runtime.cpus import usable_cpus

    ray.shutdown()  # the previous section's node: its workers had another environment
    ray.init(
        address="local",
        num_cpus=max(2, usable_cpus()),
        num_gpus=gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=object_store_bytes,
        log_to_driver=False,
        configure_logging=False,
    )


async def run_bench(port: int, plan: Plan, rates, prompts: int, seed: int, out: Path) -> list:
    """`pdserve bench` in its own process (the client's CPU stays out of the router's loop), through
    gpu_serve_bench.py, which also notes each request's server timings: one result per rate, with
    the KV handoff of its requests."""
    command = [sys.executable, str(ROOT / "scripts/gpu_serve_bench.py"), "--port", str(port)]
    command += ["--model", plan.model, "--tokenizer", "default", "--num-prompts", str(prompts)]
    command += ["--random-input-len", str(plan.input_tokens)]
    command += ["--random-output-len", str(plan.output_tokens)]
    command += ["--request-rate", ",".join(f"{rate:g}" for rate in rates)]
    command += ["--seed", str(seed), "--metric-percentiles", "50,90,99", "--disable-tqdm"]
    command += ["--result-file", str(out), "--timeout-s", "120", "--goodput", *GOODPUT_SLOS]
    bench = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await bench.communicate()
    if bench.returncode != 0 or not out.is_file():
        raise RuntimeError(f"pdserve bench failed ({bench.returncode}): {output.decode()[-3000:]}")
    handoffs = json.loads(Path(f"{out}.handoff.json").read_text())
    results = json.loads(out.read_text())["results"]
    for result, notes in zip(results, handoffs):
        result.pop("requests", None)  # per-request lists: the handoff keeps its own
        result["kv_handoff"] = handoff_figures(notes)
    return results


def handoff_figures(notes: list[dict]) -> dict:
    """Per request (the server's final timings): KV bytes, handoff ms and its share of the TTFT."""
    import numpy as np

    shipped = [n for n in notes if n["kv_bytes"] > 0]
    figures = {
        "requests": len(notes),
        "requests_with_kv_handoff": len(shipped),
        "kv_bytes": [n["kv_bytes"] for n in shipped],
        "kv_transfer_ms": [round(n["kv_transfer_s"] * 1e3, 3) for n in shipped],
        "ttft_ms": [round(n["ttft_s"] * 1e3, 3) for n in shipped],
    }
    if shipped:
        ms = np.array(figures["kv_transfer_ms"])
        share = ms / np.maximum(np.array(figures["ttft_ms"]), 1e-6)
        figures.update(
            median_kv_transfer_ms=float(np.median(ms)),
            p99_kv_transfer_ms=float(np.percentile(ms, 99)),
            median_kv_share_of_ttft=float(np.median(share)),
            p99_kv_share_of_ttft=float(np.percentile(share, 99)),
            kv_gb_s=float(np.sum(figures["kv_bytes"]) / max(np.sum(ms) / 1e3, 1e-9) / 1e9),
        )
    return figures


async def greedy_through_system(port: int, prompts: list[list[int]], max_tokens: int) -> list:
    from pdserve.client import PdserveClient

    with PdserveClient(port=port, timeout_s=120) as client:
        requests = [
            client.request(token_ids=ids, max_tokens=max_tokens, temperature=0) for ids in prompts
        ]
        done = await asyncio.gather(*(asyncio.to_thread(client.generate, r) for r in requests))
    return [list(d.token_ids) for d in done]


def greedy_reference(plan: Plan, device: str) -> tuple[list[list[int]], list[list[int]]]:
    """The single-process engine's greedy tokens for the plan's chat prompts (before any worker
    starts)."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams
    from gpu_engine import CHAT_PROMPTS  # the device engine check's prompts (scripts/)

    engine = LLMEngine(EngineConfig(model=plan.model, dtype=plan.dtype, device=device))
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": text}])
        for text in CHAT_PROMPTS[: plan.greedy_prompts]
    ]
    params = SamplingParams(max_tokens=plan.greedy_tokens, temperature=0)
    tokens = [r.token_ids for r in engine.generate(prompts, params)]
    del engine
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
    return prompts, tokens


async def serve_and_bench(plan: Plan, mode_name: str, device: str, args, reference) -> dict:
    from pdserve.system import ServeConfig, start_system

    num_prefill, num_decode = WORKERS[mode_name]
    config = ServeConfig(
        model=plan.model,
        dtype=plan.dtype,
        device=device,
        mode=mode_name,
        transport=args.transport,
        num_prefill=max(1, num_prefill),
        num_decode=num_decode,
        port=0,
        kv_cache_bytes=plan.kv_cache_bytes,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        pd_policy="remote",  # every request hands its KV off: the handoff is what is measured
        lend_cores="off" if device == "cuda" else "all",
        object_store_bytes=args.object_store_bytes,
        tokenizer="default",  # a dummy: model has none; the default model's for both
    )
    baseline = gpu_memory_used_bytes(device)
    started = time.perf_counter()
    system = await start_system(config)
    row = {
        "mode": mode_name,
        "workers": f"{num_prefill}P+{num_decode}D" if num_prefill else f"{num_decode} colocated",
        "start_s": round(time.perf_counter() - started, 1),
    }
    try:
        with tempfile.TemporaryDirectory() as scratch:
            # first use: Triton compiles, CUDA graphs, allocator pools
            await run_bench(
                system.port, plan, [math.inf], plan.warmup_prompts, 99, Path(scratch, "w.json")
            )
            row["rates"] = await run_bench(
                system.port, plan, plan.rates, plan.prompts_per_rate, 1, Path(scratch, "r.json")
            )
        for result in row["rates"]:
            print(summary_line(plan, mode_name, result), flush=True)
        if reference is not None:
            prompts, expected = reference
            got = await greedy_through_system(system.port, prompts, plan.greedy_tokens)
            row["greedy_identical"] = [a == b for a, b in zip(got, expected)]
    finally:
        await system.stop()
        await asyncio.to_thread(wait_for_gpu_memory, device, baseline)
    return row


def gpu_memory_used_bytes(device: str) -> Optional[int]:
    if device != "cuda":
        return None
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used


def wait_for_gpu_memory(device: str, baseline: Optional[int], timeout_s: float = 60.0) -> None:
    """Stopped actors free their GPU memory when their processes exit: the next system waits for
    it."""
    if baseline is None:
        return
    deadline = time.monotonic() + timeout_s
    while (used := gpu_memory_used_bytes(device)) > baseline + GIB:
        if time.monotonic() > deadline:
            print(f"warning: {used / GIB:.1f} GiB still used on the GPU after {timeout_s:g} s")
            return
        time.sleep(0.5)


# -- report ----------------------------------------------------------------------------------------


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def summary_line(plan: Plan, mode: str, r: dict) -> str:
    kv = r["kv_handoff"]
    share = kv.get("median_kv_share_of_ttft")
    return (
        f"[{plan.name} {mode} {r['request_rate']:g} req/s] {r['completed']} ok {r['failed']} "
        f"failed; TTFT p50 {_ms(r['median_ttft_ms'])} p99 {_ms(r['p99_ttft_ms'])} ms; TPOT p50 "
        f"{_ms(r['median_tpot_ms'])} ms; ITL p99 {_ms(r['p99_itl_ms'])} ms; "
        f"{r['output_throughput']:.0f} out tok/s; goodput {r['request_goodput'] or 0:.2f} req/s; "
        f"KV handoff p50 {_ms(kv.get('median_kv_transfer_ms'))} ms"
        + ("" if share is None else f" ({100 * share:.1f} % of TTFT)")
    )


def judge(report: dict) -> dict:
    """The targets, on the disaggregated system at its highest rate (under load); throughput at
    any."""
    verdicts = {}
    for name, section in report["sections"].items():
        if not section.get("ok"):
            continue
        disaggregated = next(r for r in section["systems"] if r["mode"] == "disaggregated")
        top = disaggregated["rates"][-1]
        share = top["kv_handoff"].get("median_kv_share_of_ttft")
        verdicts[name] = {
            "ttft_p50_ms_under_load": top["median_ttft_ms"],
            "ttft_ok": (top["median_ttft_ms"] or 1e9) < TARGETS["ttft_p50_ms"],
            "tpot_p50_ms": top["median_tpot_ms"],
            "tpot_ok": (top["median_tpot_ms"] or 1e9) < TARGETS["tpot_p50_ms"],
            "best_output_tok_s": max(r["output_throughput"] for r in disaggregated["rates"]),
            "kv_share_of_ttft": share,
            "kv_share_ok": share is not None and share <= TARGETS["kv_share"],
        }
        verdicts[name]["output_ok"] = verdicts[name]["best_output_tok_s"] >= TARGETS["output_tok_s"]
    return verdicts


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        f"# Serving check on {report['device_name']} ({report['device']}), {report['date']}",
        "",
        f"`{report['command']}`; transport {report['transport']}; torch {report['torch']}, "
        f"Python {report['python']}; {report['total_s']:.0f} s.",
        "",
        "| model | system | rate | done/failed | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 "
        "ms | out tok/s | goodput req/s | KV handoff p50 ms (% of TTFT) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, section in report["sections"].items():
        if not section.get("ok"):
            lines.append(f"| {name} | FAILED: {section['error'][:200]} |||||||||")
            continue
        for system in section["systems"]:
            for r in system["rates"]:
                kv = r["kv_handoff"]
                share = kv.get("median_kv_share_of_ttft")
                lines.append(
                    f"| {section['model']} | {system['workers']} | {r['request_rate']:g} | "
                    f"{r['completed']}/{r['failed']} | {_ms(r['median_ttft_ms'])} / "
                    f"{_ms(r['p99_ttft_ms'])} | {_ms(r['median_tpot_ms'])} / "
                    f"{_ms(r['p99_tpot_ms'])} | {_ms(r['median_itl_ms'])} / "
                    f"{_ms(r['p99_itl_ms'])} | {r['output_throughput']:.0f} | "
                    f"{r['request_goodput'] or 0:.2f} | {_ms(kv.get('median_kv_transfer_ms'))}"
                    + ("" if share is None else f" ({100 * share:.1f} %)")
                    + " |"
                )
    lines += ["", "Targets (disaggregated, highest rate): " + json.dumps(report["targets"])]
    path.write_text("\n".join(lines) + "\n")


def write_report(report: dict, stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    write_markdown(report, stem.with_suffix(".md"))


# -- the run ---------------------------------------------------------------------------------------


async def run_section(plan: Plan, device: str, args) -> dict:
    if plan.model == "default":
        from engine import gguf_loader
        from engine.default_model import default_model_path

        if not gguf_loader.read_metadata(default_model_path())[1]:
            raise RuntimeError(
                "the default model is installed as its tokenizer alone: stage every part of "
                ".gpu_wheels first (scripts/gpu_wheels.py)"
            )
    reference = greedy_reference(plan, device) if plan.greedy_prompts else None
    systems = [await serve_and_bench(plan, mode, device, args, reference) for mode in plan.modes]
    return {"model": plan.model, "dtype": plan.dtype, "plan": plan.__dict__, "systems": systems}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    import traceback

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the CPU test")
    parser.add_argument(
        "--sections",
        default=None,
        help="comma-separated, of 8b, 8b_ipc (cuda only), default; default: all there are",
    )
    parser.add_argument("--transport", default="ray", choices=["ray", "grpc"])
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks/results/gpu"))
    parser.add_argument("--object-store-bytes", type=int, default=None)
    args = parser.parse_args(argv)
    ensure_installed()
    from engine.dtypes import resolve_device

    device = resolve_device(args.device)
    plans = QUICK if args.quick else FULL
    usable = [n for n, plan in plans.items() if device == "cuda" or not plan.cuda_ipc]
    chosen = [s.strip() for s in (args.sections or ",".join(usable)).split(",") if s.strip()]
    if unknown := sorted(set(chosen) - set(usable)):
        parser.error(f"unknown sections {unknown} on {device}; choose from {', '.join(usable)}")
    if args.object_store_bytes is None:  # 8B: 128 MiB of KV per 1k-token request in the store
        args.object_store_bytes = (4 * GIB) if device == "cuda" else (256 << 20)
    if args.quick:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the CPU test shares its cores
    print(f"python {platform.python_version()} at {sys.executable}, device {device}", flush=True)
    import torch

    started = time.perf_counter()
    report = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "quick": args.quick,
        "transport": args.transport,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(["scripts/gpu_serve_check.py", *(argv or sys.argv[1:])]),
        "targets": {},
        "sections": {},
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"serve_check_{device}{'_quick' if args.quick else ''}_{'_'.join(chosen)}"
    for name in chosen:
        section_started = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            init_ray(device, args.object_store_bytes, plans[name].cuda_ipc)
            section = {"ok": True, **asyncio.run(run_section(plans[name], device, args))}
        except Exception as error:
            section = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            section["traceback"] = traceback.format_exc()[-4000:]
            print(section["traceback"], flush=True)
        section["seconds"] = round(time.perf_counter() - section_started, 1)
        print(
            f"[{name}] {'ok' if section['ok'] else 'FAILED'} in {section['seconds']} s", flush=True
        )
        report["sections"][name] = section
        report["total_s"] = time.perf_counter() - started
        report["targets"] = judge(report)
        write_report(report, out_dir / stem)  # after every section: a run cut short keeps them
    for name, verdict in report["targets"].items():
        print(f"targets [{name}]: {json.dumps(verdict)}")
    print(f"wrote {out_dir / stem}.json and .md")
    return 0 if all(s["ok"] for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
