"""A profile of a GPU shape from what `scripts/gpu_check.py` measured (benchmarks/results/gpu/), for
planning at scale where this machine has no GPU.

    python -m pdserve.planner.gpu_profile benchmarks/results/gpu/h200_speed.json --out h200-8b.json

What is measured there and used as it is:
- prefill: the engine's TTFT of one prompt alone at 128..4096 tokens
  (`engine_speed.pdserve.ttft_ms`);
- decode at batch 1: the TPOT of one stream (`tpot_ms`, CUDA graphs on), at its mean context;
- decode at batch B: the batch run (B prompts of P tokens, O output tokens each, `batch_s`), less
  its prefill (B x P tokens at the slope of the two longest measured prompts), over its O - 1 steps;
- the KV handoff: `kv_handoff`'s pinned host round trip (GPU -> host -> GPU, the path a transfer
  between nodes takes through host memory) and CUDA IPC within a node, at the measured sizes.
What is derived, and says so in the profile's notes:
- decode at a longer context: each sequence also reads its extra KV at the HBM read bandwidth, taken
  as twice the measured device-to-device copy rate (a copy reads and writes);
- KV capacity: `kv_fraction` of the GPU's memory left after the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from pdserve.planner.profile import DecodePoint, HandoffPoint, PrefillPoint, Profile

# Llama-3-8B: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes (bf16)
SHAPES = {"dummy:llama-3-8b": {"kv_bytes_per_token": 131072, "weight_bytes": 16_060_000_000}}
GPU_MEMORY_BYTES = {"NVIDIA H200": 141 * 10**9}


def from_gpu_check(
    speed: dict,
    batch_requests: int = 64,
    batch_prompt_tokens: int = 512,
    batch_output_tokens: int = 128,
    stream_context_tokens: int = 512 + 64,
    long_context_tokens: int = 4096,
    gpus_per_node: int = 8,
    kv_fraction: float = 0.9,
    router_cpu_s_per_token: float = 80e-6,
) -> Profile:
    """`speed`: scripts/gpu_check.py's JSON (engine_speed and kv_handoff sections). The batch sizes
    are those of scripts/gpu_common.py's FULL sizes, which wrote the stored result."""
    engine = speed["sections"]["engine_speed"]
    figures = engine["pdserve"]
    model = engine["model"]
    shape = SHAPES[model]
    prefill = tuple(
        PrefillPoint(int(tokens), 1, ms / 1e3) for tokens, ms in figures["ttft_ms"].items()
    )
    ordered = sorted((p.prompt_tokens, p.seconds) for p in prefill)
    (x0, y0), (x1, y1) = ordered[-2:]
    slope_s = (y1 - y0) / (x1 - x0)
    batch_prefill_s = batch_requests * batch_prompt_tokens * slope_s
    batch_step_s = (figures["batch_s"] - batch_prefill_s) / (batch_output_tokens - 1)
    one_step_s = figures["tpot_ms"] / 1e3
    copies = speed["sections"]["kv_handoff"]["cases"]
    read_bytes_s = 2 * max(c["device_copy_gb_s"] for c in copies) * 1e9
    per_token_read_s = shape["kv_bytes_per_token"] / read_bytes_s
    batch_context = batch_prompt_tokens + batch_output_tokens // 2
    extra = long_context_tokens - stream_context_tokens
    decode = (
        DecodePoint(1, stream_context_tokens, 1, one_step_s),
        DecodePoint(batch_requests, batch_context, 1, batch_step_s),
        DecodePoint(1, long_context_tokens, 1, one_step_s + extra * per_token_read_s),
        DecodePoint(
            batch_requests,
            long_context_tokens,
            1,
            batch_step_s
            + batch_requests * (long_context_tokens - batch_context) * per_token_read_s,
        ),
    )
    handoff = []
    for case in copies:
        handoff.append(
            HandoffPoint(
                "pinned",
                case["kv_bytes"],
                case["kv_bytes"] / (case["pinned_round_trip_gb_s"] * 1e9),
            )
        )
        handoff.append(
            HandoffPoint(
                "cuda_ipc", case["kv_bytes"], case["kv_bytes"] / (case["cuda_ipc_gb_s"] * 1e9)
            )
        )
    memory = GPU_MEMORY_BYTES.get(speed.get("device_name", ""), None)
    capacity: Optional[int] = (
        int((memory * kv_fraction - shape["weight_bytes"]) // shape["kv_bytes_per_token"])
        if memory
        else None
    )
    return Profile(
        machine={
            "cpu_model": speed.get("device_name"),
            "cpu_capability": "cuda",
            "cores": gpus_per_node,  # a worker is one GPU; a node holds this many
            "torch": speed.get("torch"),
            "model": model,
            "dtype": engine["dtype"],
            "source": "scripts/gpu_check.py: " + speed.get("command", ""),
        },
        kv_bytes_per_token=shape["kv_bytes_per_token"],
        router_cpu_s_per_token=router_cpu_s_per_token,
        prefill=prefill,
        decode=decode,
        handoff=tuple(handoff),
        kv_capacity_tokens=capacity,
        notes=(
            f"decode at batch {batch_requests}: the batch run less its prefill "
            f"({batch_prefill_s * 1e3:.0f} ms at {slope_s * 1e6:.1f} us/token) over "
            f"{batch_output_tokens - 1} steps",
            f"decode at {long_context_tokens} tokens: derived, "
            f"+ {per_token_read_s * 1e9:.1f} ns per "
            f"sequence per context token (KV read at {read_bytes_s / 1e12:.2f} TB/s)",
            f"kv_capacity_tokens: {kv_fraction:.0%} of {memory} bytes less {shape['weight_bytes']} "
            "of weights",
            "router_cpu_s_per_token: docs/benchmarks.md's router_bench, "
            "steady router CPU per token "
            "at stream interval 1 (0.07-0.09 ms on a CPU core of the 2-core machine)",
        ),
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.planner.gpu_profile")
    parser.add_argument(
        "speed_json", help="scripts/gpu_check.py output with engine_speed, kv_handoff"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args(argv)
    speed = json.loads(Path(args.speed_json).read_text())
    profile = from_gpu_check(speed, gpus_per_node=args.gpus_per_node)
    profile.save(args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
