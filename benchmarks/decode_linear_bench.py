"""A model's linears at decode batch sizes (or prefill chunks: `--rows 512`), in one process. fp32:
MKL on the transposed weights, oneDNN on its packed copies, and engine/csrc/decode_linear.c on
panels (engine/cpu_packing.py); bf16 (`--dtype bfloat16`, AVX512-BF16 CPUs): oneDNN on its packed
copies (the path where AMX is) and engine/csrc/decode_linear_bf16.c on its panels.

The shapes are the default model's (SmolLM2-135M: per layer q/k/v 576 -> 960, o 576 -> 576, gate/up
576 -> 3072, down 1536 -> 576, 30 layers, and the tied head 576 -> 49152), random weights; each
batch size times one pass over all of them, best of `--repeats`, so a pass reads the whole 540 MB of
weights from memory (nothing stays cached between layers); 270 MB in bf16.

    .venv/bin/python -m benchmarks.decode_linear_bench [--threads 1] [--rows 1,2,4,8,16,32]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.cpu_packing import (
    BF16_DECODE_LINEAR_SOURCE,
    DECODE_LINEAR_SOURCE,
    DecodeLinear,
    bf16_decode_panels,
    build,
    decode_panels,
)

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LAYERS = 30
VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(576, VOCAB)]
    weights = [
        (torch.randn(out, inner, generator=generator) * 0.02).to(dtype) for inner, out in shapes
    ]
    # the packing hint oneDNN gets in the engine (cpu_packing.PackedLinear) for bf16
    packed = [
        torch.ops.mkldnn._reorder_linear_weight(w, 1 if dtype == torch.bfloat16 else 32)
        for w in weights
    ]
    paths = {
        "oneDNN packed": lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        )
    }
    if dtype == torch.bfloat16:
        kernel = DecodeLinear(build(source=BF16_DECODE_LINEAR_SOURCE), torch.bfloat16)
        panels = [bf16_decode_panels(w) for w in weights]
    else:
        kernel = DecodeLinear(build(source=DECODE_LINEAR_SOURCE))
        transposed = [w.t().contiguous() for w in weights]
        panels = [decode_panels(w) for w in transposed]
        paths["MKL"] = lambda x, i: torch.mm(x, transposed[i])
    paths["kernel (panels)"] = lambda x, i: kernel(x, panels[i], None)
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, threads "
        f"{args.threads}; one pass over the model's linears, best of {args.repeats} (ms):"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {
            inner: torch.randn(rows, inner, generator=generator).to(dtype) for inner, _ in shapes
        }
        best = {}
        for _ in range(args.repeats):  # the paths alternate, so they share the machine's state
            for name, path in paths.items():
                started = time.perf_counter()
                for i, (inner, _) in enumerate(shapes):
                    path(inputs[inner], i)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - started)
        print(f"  rows {rows:3d}: " + ", ".join(f"{n} {s * 1e3:6.1f}" for n, s in best.items()))


if __name__ == "__main__":
    main()
