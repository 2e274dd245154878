"""The Triton paged decode kernel (engine/triton_paged_attention.py) against the float64 reference,
run on CPU tensors by Triton's interpreter.

Triton reads TRITON_INTERPRET when a kernel is decorated, that is when its module is first imported,
so setting it in the test process would hold only if nothing had imported the kernel before. The
kernel therefore runs in a child process started with the variable set (this file run as a script);
it saves its outputs, and the assertions run here. Triton is a dependency of the project: without it
the child fails, and so does every test below.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_paged_attention import _paged_case, _reference

ROOT = Path(__file__).resolve().parent.parent

# id: (num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype)
LENS = [1, 15, 16, 17, 300, 33]  # one token, both sides of a block boundary, a long one
CASES = {
    "smollm2-f32": (9, 3, 64, 16, LENS, torch.float32),
    "smollm2-bf16": (9, 3, 64, 16, LENS, torch.bfloat16),
    # a tile of 32 tokens spans 8 blocks
    "no-grouping-block4-f32": (4, 4, 32, 4, LENS, torch.float32),
    "llama3-8b-grouping-bf16": (8, 2, 128, 16, LENS, torch.bfloat16),
    "llama3-8b-grouping-f32": (8, 2, 128, 16, [64, 1, 129], torch.float32),
    # head_dim padded to 128
    "head-dim-80-block8-f32": (4, 2, 80, 8, [1, 8, 64, 77], torch.float32),
    # tile == block, group padded
    "group3-block32-bf16": (6, 2, 64, 32, [32, 1, 95, 64], torch.bfloat16),
    "f16": (4, 2, 64, 16, [5, 48], torch.float16),
}
# as the CPU kernel's tests
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Contexts split into partitions (flash decoding): 3 leaves ragged ones, 7 more than a short
# context's tiles (empty partitions, which must weigh nothing).
PARTITIONS = (3, 7)
POISONED = "poisoned"  # rows no sequence owns hold huge K and NaN V: they must never be read


def _case(name: str):
    num_heads, num_kv_heads, head_dim, block_size, lens, dtype = CASES[name]
    seed = sorted(CASES).index(name)
    return _paged_case(
        num_heads, num_kv_heads, head_dim, block_size, lens, dtype, seed=seed
    ), head_dim**-0.5


def _poisoned_case():
    (q, k_cache, v_cache, tables, lens), scale = _case("smollm2-f32")
    block_size = k_cache.shape[1]
    owned = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        slots = tables[b].repeat_interleave(block_size) * block_size + torch.arange(
            block_size
        ).repeat(tables.shape[1])
        owned[slots[:n]] = True
    k_cache.view(-1, *k_cache.shape[2:])[~owned] = 1e4
    v_cache.view(-1, *v_cache.shape[2:])[~owned] = float("nan")
    return (q, k_cache, v_cache, tables, lens), scale


def _all_inputs():
    inputs = {name: _case(name) for name in CASES}
    inputs[POISONED] = _poisoned_case()
    return inputs


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Every case's output from the kernel under Triton's interpreter, computed in one child
    process."""
    out = tmp_path_factory.mktemp("triton") / "outputs.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, __file__, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0, f"the interpreted kernel failed:\n{child.stderr[-4000:]}"
    return torch.load(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_matches_a_float64_reference(interpreted, name):
    (q, k_cache, v_cache, tables, lens), scale = _case(name)
    got = interpreted[name]
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(
        got.double(),
        _reference(q, k_cache, v_cache, tables, lens, scale),
        atol=TOLERANCE[q.dtype],
        rtol=0,
    )


@pytest.mark.parametrize("partitions", PARTITIONS)
@pytest.mark.parametrize(
    "name", ["smollm2-f32", "llama3-8b-grouping-bf16", "no-grouping-block4-f32", "f16"]
)
def test_a_context_split_into_partitions_matches_the_reference(interpreted, name, partitions):
    (q, k_cache, v_cache, tables, lens), scale = _case(name)
    got = interpreted[f"{name}/{partitions}"]
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(
        got.double(),
        _reference(q, k_cache, v_cache, tables, lens, scale),
        atol=TOLERANCE[q.dtype],
        rtol=0,
    )


def test_rows_outside_a_sequence_never_leak_into_it(interpreted):
    assert torch.equal(interpreted[POISONED], interpreted["smollm2-f32"])


def _run_interpreted(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "run with TRITON_INTERPRET=1 (the test fixture does)"
    )
    from engine.triton_paged_attention import TritonPagedDecodeAttention

    kernel = TritonPagedDecodeAttention()
    outputs = {}
    for name, (tensors, scale) in _all_inputs().items():
        outputs[name] = kernel(*tensors, scale)
        if name in ("smollm2-f32", "llama3-8b-grouping-bf16", "no-grouping-block4-f32", "f16"):
            for partitions in PARTITIONS:
                outputs[f"{name}/{partitions}"] = kernel(*tensors, scale, num_partitions=partitions)
    torch.save(outputs, out_path)


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])
