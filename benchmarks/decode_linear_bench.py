"""A model's fp32 linears at decode batch sizes: MKL on the transposed weights, oneDNN on its packed
copies, and engine/csrc/decode_linear.c on panels (engine/cpu_packing.py), in one process.

The shapes are the default model's (SmolLM2-135M: per layer q/k/v 576 -> 960, o 576 -> 576, gate/up
576 -> 3072, down 1536 -> 576, 30 layers, and the tied head 576 -> 49152), random weights; each
batch size times one pass over all of them, best of `--repeats`, so a pass reads the whole 540 MB of
weights from memory (nothing stays cached between layers).

    .venv/bin/python -m benchmarks.decode_linear_bench [--threads 1] [--rows 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.cpu_packing import DECODE_LINEAR_SOURCE, DecodeLinear, build, decode_panels

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LAYERS = 30
VOCAB = 49152


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = DecodeLinear(build(source=DECODE_LINEAR_SOURCE))
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(576, VOCAB)]
    weights = [torch.randn(out, inner, generator=generator) * 0.02 for inner, out in shapes]
    transposed = [w.t().contiguous() for w in weights]
    panels = [decode_panels(w) for w in transposed]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    paths = {
        "MKL": lambda x, i: torch.mm(x, transposed[i]),
        "oneDNN packed": lambda x, i: torch.ops.mkldnn._linear_pointwise(
            x, packed[i], None, "none", [], ""
        ),
        "kernel (panels)": lambda x, i: kernel(x, panels[i], None),
    }
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, threads {args.threads}; "
        "one pass over the model's linears, best of "
        f"{args.repeats} (ms):"
    )
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {inner: torch.randn(rows, inner, generator=generator) for inner, _ in shapes}
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
