"""The device check's attention sections: which fused SDPA kernels take the engine's prefill call
(`prefill_backend`), bf16 accuracy against float64 (`attention_accuracy`), and the paged decode
kernel against the gather path (`decode_kernel`)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from gpu_common import FULL, Clock, Sizes, time_call

# -- prefill attention backend --------------------------------------------------------------------


def check_prefill_backend(device: str, sizes: Sizes) -> dict:
    """The engine's first-chunk prefill call (engine.model.Attention._prefill_attention), 8B head
    shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens, heads, kv_heads, head_dim = 512 if sizes is FULL else 64, 32, 8, 128
    make = lambda n: torch.randn(1, n, tokens, head_dim, device=device, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    runs = {}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=head_dim**-0.5, enable_gqa=True
                )
            runs[name] = "runs"
        except RuntimeError as error:
            runs[name] = f"refused: {str(error).splitlines()[0][:120]}"
    return {"backends": runs, "fused": any(r == "runs" for r in runs.values())}


# -- attention accuracy in 16-bit ------------------------------------------------------------------


def _causal_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 causal attention; q `[n, heads, d]`, k/v `[n, kv_heads, d]`; returns `[n, heads,
    d]`."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1),
    )
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def check_attention_accuracy(device: str, sizes: Sizes) -> dict:
    """The engine's prefill attention call (`Attention._prefill_attention`, a fresh prompt) and
    other ways of making the same SDPA call, in bf16, against float64: the largest difference of
    each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engine.config import ModelConfig
    from engine.model import Attention, ForwardBatch, PrefillSlice

    rows = []
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):  # SmolLM2-135M, Llama-3-8B
        config = ModelConfig(
            name="probe",
            vocab_size=16,
            hidden_size=heads * head_dim,
            intermediate_size=16,
            num_layers=1,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_context_tokens=4096,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
        )
        attention = Attention(config)
        for n in (37, 512):
            generator = torch.Generator(device=device).manual_seed(n)

            def make(h):
                return torch.randn(n, h, head_dim, generator=generator, device=device).to(
                    torch.bfloat16
                )

            q, k, v = make(heads), make(kv_heads), make(kv_heads)
            reference = _causal_reference(q, k, v, attention.scale)
            batch = ForwardBatch(
                positions=torch.arange(n, device=device),
                slot_mapping=torch.arange(n, device=device),
                prefill_slices=[
                    PrefillSlice(0, n, n, torch.zeros(1, dtype=torch.long, device=device))
                ],
            )
            # [1, heads, n, d], strided as the engine's
            layout = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
            unlayout = lambda t: t[0].transpose(0, 1)  # noqa: E731

            def sdpa(q4, k4, v4, gqa=True):
                return unlayout(
                    F.scaled_dot_product_attention(
                        q4, k4, v4, is_causal=True, scale=attention.scale, enable_gqa=gqa
                    )
                )

            group = heads // kv_heads
            variants = {
                "engine": lambda: attention._prefill_attention(q, k, v, None, None, batch).view(
                    n, heads, head_dim
                ),
                "strided_gqa": lambda: sdpa(layout(q), layout(k), layout(v)),
                "contiguous_gqa": lambda: sdpa(
                    layout(q).contiguous(), layout(k).contiguous(), layout(v).contiguous()
                ),
                "repeated_kv": lambda: sdpa(
                    layout(q),
                    layout(k.repeat_interleave(group, 1)),
                    layout(v.repeat_interleave(group, 1)),
                    False,
                ),
            }
            row = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": n}
            for name, fn in variants.items():
                try:
                    row[name] = (fn().double() - reference).abs().max().item()
                except Exception as error:
                    row[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
            try:
                with sdpa_kernel([SDPBackend.MATH]):
                    row["math_backend_gqa"] = (
                        (variants["strided_gqa"]().double() - reference).abs().max().item()
                    )
            except Exception as error:
                row["math_backend_gqa"] = (
                    f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
                )
            rows.append(row)
    return {
        "prefill_bf16_max_abs_difference_vs_float64": rows,
        "decode_bf16_max_abs_difference_vs_float64": _decode_accuracy(device),
    }


def _decode_accuracy(device: str) -> list[dict]:
    """The paged decode kernel in bf16 (every partition count it may pick, and one) against
    float64."""
    from engine.paged_attention import decode_kernel_for

    kernel, rows, block_size, lens = decode_kernel_for(device), [], 16, [1, 17, 300, 640]
    if kernel is None:
        return rows
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):
        generator = torch.Generator(device=device).manual_seed(heads)
        width = -(-max(lens) // block_size)
        num_blocks = len(lens) * width + 1
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        tables = torch.randperm(num_blocks, generator=generator, device=device)[
            : len(lens) * width
        ].view(len(lens), width)
        q = torch.randn(len(lens), heads, head_dim, generator=generator, device=device).to(
            torch.bfloat16
        )
        context_lens = torch.tensor(lens, device=device)
        scale = head_dim**-0.5
        reference = torch.stack(
            [
                _last_query_reference(
                    q[b],
                    k_cache[tables[b]].flatten(0, 1)[:n],
                    v_cache[tables[b]].flatten(0, 1)[:n],
                    scale,
                )
                for b, n in enumerate(lens)
            ]
        )
        row = {
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "context_tokens": lens,
            "default": (
                kernel(q, k_cache, v_cache, tables, context_lens, scale).double() - reference
            )
            .abs()
            .max()
            .item(),
        }
        if _splits_contexts(kernel):
            for parts in (1, 3, 32):
                got = kernel(q, k_cache, v_cache, tables, context_lens, scale, num_partitions=parts)
                row[f"partitions_{parts}"] = (got.double() - reference).abs().max().item()
        rows.append(row)
    return rows


def _last_query_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 attention of one query `[heads, d]` over all of k/v `[n, kv_heads, d]`."""
    group = q.shape[0] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


# -- the paged decode kernel -----------------------------------------------------------------------


def check_decode_kernel(device: str, sizes: Sizes) -> dict:
    from engine.config import NAMED_SHAPES
    from engine.model import Attention, ForwardBatch
    from engine.paged_attention import decode_kernel_for

    kernel = decode_kernel_for(device)
    if kernel is None:
        raise RuntimeError(
            f"no paged decode kernel for {device} (disabled, or Triton / a C compiler missing)"
        )
    config = NAMED_SHAPES["llama-3-8b"]
    attention = Attention(config)
    block_size, clock, rows = 16, Clock(device), []
    generator = torch.Generator(device=device).manual_seed(0)
    for batch, context in sizes.decode_cases:
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq + 1
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        v_cache = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        tables = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(
            batch, blocks_per_seq
        )
        lens = torch.full((batch,), context, dtype=torch.long, device=device)
        q = torch.randn(
            batch, config.num_heads, config.head_dim, generator=generator, device=device
        ).to(torch.bfloat16)
        info = ForwardBatch(
            positions=lens - 1,
            slot_mapping=lens,
            decode_block_tables=tables,
            decode_context_lens=lens,
        )
        assert kernel.supports(k_cache)
        attention.decode_kernel = None
        gathered = lambda: attention._decode_attention(q, k_cache, v_cache, info)  # noqa: E731
        paged = lambda: kernel(q, k_cache, v_cache, tables, lens, attention.scale)  # noqa: E731
        difference = (paged().float().view(batch, -1) - gathered().float()).abs().max().item()
        split_difference = None  # the Triton kernel splits long contexts; the CPU kernel never does
        if _splits_contexts(kernel):
            one_partition = kernel(
                q, k_cache, v_cache, tables, lens, attention.scale, num_partitions=1
            )
            split_difference = (paged().float() - one_partition.float()).abs().max().item()
        rows.append(
            {
                "batch": batch,
                "context_tokens": context,
                "kernel": type(kernel).__name__,
                "paged_ms": time_call(paged, clock, sizes.repeats) * 1e3,
                "gather_sdpa_ms": time_call(gathered, clock, sizes.repeats) * 1e3,
                "max_abs_difference": difference,
                "split_vs_one_partition_max_abs_difference": split_difference,
            }
        )
    return {"cases": rows}


def _splits_contexts(kernel) -> bool:
    """Whether a decode kernel splits contexts into partitions (the Triton one; the CPU kernel never
    does)."""
    return "num_partitions" in inspect.signature(kernel).parameters
