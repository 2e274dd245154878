"""The self-check of one kernel build, run in a child process by engine/kernels.py before any worker
uses the build: `python -m engine.kernel_check <op> <variant> <library>`.

Every path of the build against a float64 reference: row and head-size tails, GQA groups, partial
tiles and key blocks, cached context, bf16 and fp32 where the op serves both, on one and two
threads, with canary bytes on both sides of each output (a kernel that writes past its output fails
even where the result is right). Prints a line per case as it goes (the parent reports the last one
reached when the child dies by a signal), then `ok` and exits 0, or `wrong: ...` and exits 3.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

_CANARY_BYTES = 64  # keeps each output 64-byte aligned, as torch allocates it
_CANARY = 0xA5
THREADS = (1, 2)


class Wrong(Exception):
    pass


def _guarded(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, its buffer): an uninitialised-looking output with canary bytes on each side."""
    size = torch.Size(shape).numel() * dtype.itemsize
    buffer = torch.full((size + 2 * _CANARY_BYTES,), _CANARY, dtype=torch.uint8)
    return buffer[_CANARY_BYTES : _CANARY_BYTES + size].view(dtype).view(shape), buffer


def _canaries_intact(buffer: torch.Tensor) -> bool:
    return bool(
        (buffer[:_CANARY_BYTES] == _CANARY).all() and (buffer[-_CANARY_BYTES:] == _CANARY).all()
    )


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _expect(name: str, got: torch.Tensor, want: torch.Tensor, buffer, atol: float, rtol=0.0):
    if not _canaries_intact(buffer):
        raise Wrong(f"{name}: wrote outside its output")
    error = (got.double() - want).abs() - rtol * want.abs()
    worst = error.max().item() if error.numel() else 0.0
    if not worst <= atol:  # NaN included
        raise Wrong(f"{name}: max error {worst:.3g} > {atol:g}")


def _atol(dtype: torch.dtype, fp32: float) -> float:
    return 1.6e-2 if dtype == torch.bfloat16 else fp32


# ---- decode attention


def decode_attention(library: Path, variant: str) -> Iterator[str]:
    from engine.paged_attention import PagedDecodeAttention

    kernel = PagedDecodeAttention(library)
    g = torch.Generator().manual_seed(0)
    # heads / kv heads / head dim (the 16-lane path, the 8-lane path, the plain loops), block size,
    # context lengths (one token, a partial block, several)
    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 4, 48), (6, 2, 40), (2, 1, 36)):
        for dtype in (torch.float32, torch.bfloat16):
            block_size, lens = 16, [1, 17, 70, 33]
            blocks = sum((n + block_size - 1) // block_size for n in lens) + 2
            k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
            v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
            width = max((n + block_size - 1) // block_size for n in lens)
            ids = torch.randperm(blocks, generator=g)
            tables, used = torch.zeros(len(lens), width, dtype=torch.long), 0
            for row, n in enumerate(lens):
                count = (n + block_size - 1) // block_size
                tables[row, :count] = ids[used : used + count]
                used += count
            q = torch.randn(len(lens), heads, head_dim, generator=g)
            lens_t = torch.tensor(lens)  # held: the kernel reads it through a pointer
            scale = head_dim**-0.5
            want = _decode_reference(q, k_cache, v_cache, tables, lens, scale)
            for threads in THREADS:
                name = f"decode {heads}/{kv_heads}x{head_dim} {dtype} threads {threads}"
                yield name
                out, buffer = _guarded(tuple(q.shape), torch.float32)
                code = kernel._functions[dtype](
                    *(_p(t) for t in (q, k_cache, v_cache, tables, lens_t, out)),
                    len(lens),
                    heads,
                    kv_heads,
                    head_dim,
                    block_size,
                    width,
                    scale,
                    threads,
                )
                if code:
                    raise Wrong(f"{name}: returned {code}")
                _expect(name, out, want, buffer, 1e-4)


def _decode_reference(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    rows = []
    for row, n in enumerate(lens):
        keys = k_cache[tables[row]].flatten(0, 1)[:n].double()  # [n, kv_heads, d]
        values = v_cache[tables[row]].flatten(0, 1)[:n].double()
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[row].double(), keys) * scale
        rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(rows)


# ---- prefill attention


def prefill_attention(library: Path, variant: str) -> Iterator[str]:
    from engine.prefill_attention import HEAD_DIM, KINDS, PrefillAttention

    kernel = PrefillAttention(KINDS[variant], library)
    g = torch.Generator().manual_seed(1)
    # new tokens, cached context: one row, partial 16-row tiles and 32-key blocks, whole ones,
    # context before the prompt
    for n, cached in ((1, 0), (15, 0), (16, 0), (33, 0), (70, 5), (1, 40), (40, 31)):
        for heads, kv_heads in ((9, 3), (4, 4)):
            q = torch.randn(n, heads, HEAD_DIM, generator=g).bfloat16()
            k = torch.randn(cached + n, kv_heads, HEAD_DIM, generator=g).bfloat16()
            v = torch.randn(cached + n, kv_heads, HEAD_DIM, generator=g).bfloat16()
            want = _prefill_reference(q, k, v)
            for threads in THREADS:
                name = f"prefill {n} after {cached}, {heads}/{kv_heads} heads, threads {threads}"
                yield name
                out, buffer = _guarded((n, heads * HEAD_DIM), torch.bfloat16)
                code = kernel._fn(
                    *(_p(t) for t in (q, k, v, out)),
                    q.stride(0),
                    k.stride(0),
                    v.stride(0),
                    n,
                    cached,
                    heads,
                    kv_heads,
                    HEAD_DIM,
                    HEAD_DIM**-0.5,
                    threads,
                )
                if code:
                    raise Wrong(f"{name}: returned {code}")
                _expect(name, out, want, buffer, 2e-2)


def _prefill_reference(q, k, v) -> torch.Tensor:
    n, cached = q.shape[0], k.shape[0] - q.shape[0]
    visible = torch.arange(cached + n).unsqueeze(0) <= torch.arange(cached, cached + n).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(0, 1) for t in (q, k, v)),
        attn_mask=visible,
        enable_gqa=True,
        scale=q.shape[-1] ** -0.5,
    )
    return out.transpose(0, 1).reshape(n, -1)


# ---- linears


def _linear(library: Path, dtype: torch.dtype, panels_of: Callable) -> Iterator[str]:
    from engine.cpu_packing import DecodeLinear

    kernel = DecodeLinear(library, dtype)
    g = torch.Generator().manual_seed(2)
    # rows: one, the narrow tiles, the wide ones and their tails, the most one call of the fp32
    # kernel takes (DecodeLinear slices more), a prefill chunk's (bf16)
    row_counts = (1, 3, 4, 5, 8, 9, 13, 17, 64) + ((70,) if dtype == torch.bfloat16 else ())
    for rows in row_counts:
        for inner, outer, with_bias in ((64, 48, True), (200, 96, False)):
            x = torch.randn(rows, inner, generator=g).to(dtype)
            weight = torch.randn(outer, inner, generator=g).to(dtype)
            bias = torch.randn(outer, generator=g).to(dtype) if with_bias else None
            panels = panels_of(weight)
            want = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
            for threads in THREADS:
                name = f"linear {rows}x{inner}->{outer} {dtype} threads {threads}"
                yield name
                out, buffer = _guarded((rows, outer), dtype)
                code = kernel._fn(
                    x.data_ptr(),
                    panels.data_ptr(),
                    None if bias is None else bias.data_ptr(),
                    out.data_ptr(),
                    rows,
                    inner,
                    outer,
                    x.stride(0),
                    out.stride(0),
                    threads,
                )
                if code:
                    raise Wrong(f"{name}: returned {code}")
                _expect(name, out, want, buffer, _atol(dtype, 1e-4), 8e-3)


def linear_bf16(library: Path, variant: str) -> Iterator[str]:
    from engine.cpu_packing import bf16_decode_panels

    return _linear(library, torch.bfloat16, bf16_decode_panels)


def linear_f32(library: Path, variant: str) -> Iterator[str]:
    from engine.cpu_packing import decode_panels

    return _linear(library, torch.float32, lambda w: decode_panels(w.t().contiguous()))


# ---- fused elementwise ops


def fused_ops(library: Path, variant: str) -> Iterator[str]:
    from engine.fused_ops import FusedOps

    ops = FusedOps(library)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        atol = _atol(dtype, 1e-4)
        for rows, cols in ((1, 64), (7, 200), (33, 576)):
            for threads in THREADS:
                tag = f"{rows}x{cols} {dtype} threads {threads}"
                x = torch.randn(rows, cols, generator=g).to(dtype)
                residual = torch.randn(rows, cols, generator=g).to(dtype)
                weight = (torch.rand(cols, generator=g) + 0.5).to(dtype)
                for with_residual in (False, True):
                    yield f"rms_norm {tag} residual {with_residual}"
                    summed = (x.double() + residual.double()) if with_residual else x.double()
                    want = summed * summed.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
                    want = want * weight.double()
                    given = x.clone()
                    out, buffer = _guarded((rows, cols), dtype)
                    code = ops._kernels["add_rms_norm", dtype](
                        _p(given),
                        _p(residual) if with_residual else ctypes.c_void_p(None),
                        _p(weight),
                        _p(out),
                        rows,
                        cols,
                        1e-5,
                        threads,
                    )
                    _check_code(code, "rms_norm")
                    _expect(f"rms_norm {tag}", out, want, buffer, atol * 4, 8e-3)
                yield f"silu_mul {tag}"
                gate_up = torch.randn(rows, 2 * cols, generator=g).to(dtype)
                gate, up = gate_up.double().split(cols, dim=-1)
                want = torch.nn.functional.silu(gate) * up
                out, buffer = _guarded((rows, cols), dtype)
                code = ops._kernels["silu_mul", dtype](_p(gate_up), _p(out), rows, cols, threads)
                _check_code(code, "silu_mul")
                _expect(f"silu_mul {tag}", out, want, buffer, atol * 4, 8e-3)
                yield f"rope {tag}"
                _rope(ops, dtype, rows, threads, g, atol)


def _rope(ops, dtype, tokens: int, threads: int, g, atol: float) -> None:
    heads, head_dim = 3, 64
    x = torch.randn(tokens, heads * head_dim + 32, generator=g).to(dtype)  # a row stride
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    rows = x[:, : heads * head_dim].double().view(tokens, heads, head_dim)
    rotated = torch.cat([rows[..., head_dim // 2 :], rows[..., : head_dim // 2]], -1)
    want = rows * cos.double() + rotated * sin.double()
    out, buffer = _guarded((tokens, heads, head_dim), dtype)
    code = ops._kernels["rope", dtype](
        _p(x), x.stride(0), _p(cos), _p(sin), _p(out), tokens, heads, head_dim, threads
    )
    _check_code(code, "rope")
    _expect(f"rope {tokens} {dtype}", out, want, buffer, atol * 4, 8e-3)


def _check_code(code: int, name: str) -> None:
    if code:
        raise Wrong(f"{name}: returned {code}")


CHECKS = {
    "decode_attention": decode_attention,
    "prefill_attention": prefill_attention,
    "linear_bf16": linear_bf16,
    "linear_f32": linear_f32,
    "fused_ops": fused_ops,
}


def main(argv: list[str]) -> int:
    op, variant, library = argv[0], argv[1], Path(argv[2])
    torch.set_num_threads(2)
    try:
        for case in CHECKS[op](library, variant):
            print(case, flush=True)
    except Wrong as wrong:
        print(f"wrong: {wrong}", flush=True)
        return 3
    print(f"ok: {op} {library.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
