"""Decode attention over the paged KV cache on CUDA: a Triton kernel with the CPU kernel's contract.

Like `engine/csrc/paged_attention.c`, it reads each sequence's K/V rows in place through its block
table (no gather, no padded copy, no mask tensor), serves GQA by letting one program handle all the
query heads of one kv head, so each K and V row is read once per kv head, and accumulates in fp32
(scores, softmax and the weighted V sum; a bf16 cache is widened on load). It differs in the order
of the sums: one pass over the context, `TILE_TOKENS` tokens at a time, with an online softmax
(running max and sum) instead of two passes over a full score row.

One program per (sequence, kv head). A tile of tokens may span several blocks: each token's row is
found through the block table, so any block size works, and the context lengths may be ragged.
Only imported where it is used (CUDA, or the interpreter in the tests): importing Triton costs time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.paged_attention import MAX_HEAD_DIM

TILE_TOKENS = 32  # context tokens per loop step; tl.dot wants every dimension >= 16
_MIN_DOT_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale,
    stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_out_seq, stride_out_head,
    group_size, head_dim, block_size,
    GROUP_ROWS: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, TILE_TOKENS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, GROUP_ROWS)  # the query heads that share this kv head, padded
    dims = tl.arange(0, HEAD_DIM_PADDED)
    row_ok = rows < group_size
    dim_ok = dims < head_dim
    heads = kv_head * group_size + rows
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

    running_max = tl.full((GROUP_ROWS,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((GROUP_ROWS,), dtype=tl.float32)
    acc = tl.zeros((GROUP_ROWS, HEAD_DIM_PADDED), dtype=tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(0, context_len, TILE_TOKENS):
        tokens = tile_start + tl.arange(0, TILE_TOKENS)
        token_ok = tokens < context_len
        block_ids = tl.load(table + tokens // block_size, mask=token_ok, other=0).to(tl.int64)
        row_offsets = block_ids * stride_cache_block + (tokens % block_size) * stride_cache_slot + kv_head * stride_cache_head
        kv_offsets = row_offsets[:, None] + dims[None, :]
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        # ieee: fp32 products and sums, never TF32, whatever the cache's dtype.
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GROUP_ROWS, TILE_TOKENS]
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        # The first tile holds at least one token (context_len >= 1), so the running max is finite from
        # then on and no exp sees -inf - -inf.
        tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - tile_max)
        probs = tl.exp(scores - tile_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = tile_max

    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


class TritonPagedDecodeAttention:
    """`__call__` computes one decode step's attention for a batch on the GPU, reading K/V blocks in
    place; the same call as `engine.paged_attention.PagedDecodeAttention` (the CPU kernel)."""

    def supports(self, cache: torch.Tensor) -> bool:
        """Whether this cache (`[blocks, block_size, kv_heads, head_dim]`) is one the kernel handles."""
        return (
            cache.device.type == "cuda" and cache.dtype in _DTYPES and cache.stride(-1) == 1
            and cache.shape[-1] <= MAX_HEAD_DIM
        )

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q `[batch, heads, head_dim]`; caches `[blocks, block_size, kv_heads, head_dim]` (K and V with
        the same strides); `context_lens` >= 1, including the new token; returns q's shape and dtype."""
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError(f"K and V caches need equal strides and contiguous rows, got {k_cache.stride()} and {v_cache.stride()}")
        q = q if q.stride(-1) == 1 else q.contiguous()
        block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        group_size = num_heads // num_kv_heads
        _paged_decode_kernel[(batch, num_kv_heads)](
            q, k_cache, v_cache, block_tables, context_lens, out,
            scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            group_size, head_dim, block_size,
            GROUP_ROWS=max(_MIN_DOT_ROWS, triton.next_power_of_2(group_size)),
            HEAD_DIM_PADDED=max(_MIN_DOT_ROWS, triton.next_power_of_2(head_dim)),
            TILE_TOKENS=TILE_TOKENS,
        )
        return out
