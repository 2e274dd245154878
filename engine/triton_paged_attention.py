"""Decode attention over the paged KV cache on CUDA: a Triton kernel with the CPU kernel's contract.

Like `engine/csrc/paged_attention.c`, it reads each sequence's K/V rows in place through its block
table (no gather, no padded copy, no mask tensor), serves GQA by letting one program handle all the
query heads of one kv head, so each K and V row is read once per kv head, and accumulates in fp32
(scores, softmax and the weighted V sum). It differs in the order of the sums: one pass over the
context, `TILE_TOKENS` tokens at a time, with an online softmax (running max and sum).

Programs: one per (sequence, kv head, partition). A few sequences alone would leave most of the GPU
idle (one sequence of the 8B shape is 8 programs on 132 SMs), so the context is split into up to
`MAX_PARTITIONS` partitions of whole tiles ("flash decoding"): each writes its unnormalised sum with
its max and denominator, and a second small kernel merges them. The number of partitions depends
only on the batch size, never on the context lengths, which stay on the device: a CUDA graph
captured once per batch size serves every length.

Products: a 16-bit cache goes through the tensor cores (16-bit inputs, fp32 accumulation; the
probabilities are rounded to the cache's dtype for the P·V product, as FlashAttention does); an fp32
cache through exact fp32 products (never TF32), the path held token-identical to HF.

A tile of tokens may span several blocks: each token's row is found through the block table, so any
block size works, and the context lengths may be ragged. Only imported where it is used (CUDA, or
the interpreter in the tests): importing Triton costs time.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from engine.paged_attention import MAX_HEAD_DIM

TILE_TOKENS = 32  # context tokens per loop step; tl.dot wants every dimension >= 16
MAX_PARTITIONS = 32
# split the context until batch x kv heads x partitions fills the GPU this often
_PROGRAMS_PER_SM = 4
_MIN_DOT_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Triton's interpreter (the CPU tests) computes a bf16 tl.dot wrongly (numpy has no bf16), so there
# bf16 takes the fp32 products; fp16 runs the 16-bit path under the interpreter, the same code.
_FP32_DOT_DTYPES = (
    (torch.float32, torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") == "1"
    else (torch.float32,)
)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    group_size,
    head_dim,
    block_size,
    num_heads,
    num_partitions,
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # This partition's tokens: whole tiles, the context's tiles shared out as evenly as they divide.
    tiles_per_part = tl.cdiv(tl.cdiv(context_len, TILE_TOKENS), num_partitions)
    start = part * tiles_per_part * TILE_TOKENS
    end = tl.minimum(context_len, start + tiles_per_part * TILE_TOKENS)

    rows = tl.arange(0, GROUP_ROWS)  # the query heads that share this kv head, padded
    dims = tl.arange(0, HEAD_DIM_PADDED)
    row_ok = rows < group_size
    dim_ok = dims < head_dim
    heads = kv_head * group_size + rows
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    running_max = tl.full((GROUP_ROWS,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((GROUP_ROWS,), dtype=tl.float32)
    acc = tl.zeros((GROUP_ROWS, HEAD_DIM_PADDED), dtype=tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(start, end, TILE_TOKENS):
        tokens = tile_start + tl.arange(0, TILE_TOKENS)
        token_ok = tokens < context_len
        block_ids = tl.load(table + tokens // block_size, mask=token_ok, other=0).to(tl.int64)
        row_offsets = (
            block_ids * stride_cache_block
            + (tokens % block_size) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        kv_offsets = row_offsets[:, None] + dims[None, :]
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if FP32_DOT:  # ieee: fp32 products and sums, never TF32
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))  # 16-bit inputs, fp32 accumulation
        scores = tl.where(token_ok[None, :], scores * scale, float("-inf"))
        # The first tile of a partition holds at least one token (start < context_len), so the
        # running max is finite from then on and no exp sees -inf - -inf.
        tile_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - tile_max)
        probs = tl.exp(scores - tile_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if FP32_DOT:
            acc = acc * correction[:, None] + tl.dot(
                probs, v.to(tl.float32), input_precision="ieee"
            )
        else:
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = tile_max

    out_mask = row_ok[:, None] & dim_ok[None, :]
    # an empty partition (start >= context_len) writes max -inf and sum 0: it weighs nothing
    if SPLIT:
        slots = (seq * num_heads + heads) * num_partitions + part
        tl.store(part_out_ptr + slots[:, None] * head_dim + dims[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + slots, running_max, mask=row_ok)
        tl.store(part_sum_ptr + slots, running_sum, mask=row_ok)
    else:
        out = acc / running_sum[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _merge_partitions_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    num_heads,
    num_partitions,
    head_dim,
    PARTITIONS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """One program per (sequence, query head): the partitions' sums, rescaled to their common
    max."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTITIONS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    part_ok = parts < num_partitions
    slots = (seq * num_heads + head) * num_partitions + parts
    maxes = tl.load(part_max_ptr + slots, mask=part_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + slots, mask=part_ok, other=0.0)
    weights = tl.exp(maxes - tl.max(maxes, axis=0))  # partition 0 is never empty: the max is finite
    partial = tl.load(
        part_out_ptr + slots[:, None] * head_dim + dims[None, :],
        mask=part_ok[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def partitions_for(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """How many partitions to split each context into: enough programs to fill the GPU a few times
    over. Depends on the batch size only (CUDA graphs); 1 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 1
    wanted = _PROGRAMS_PER_SM * _multiprocessors(device)
    return max(1, min(MAX_PARTITIONS, -(-wanted // (batch * num_kv_heads))))


class TritonPagedDecodeAttention:
    """`__call__` computes one decode step's attention for a batch on the GPU, reading K/V blocks in
    place; the same call as `engine.paged_attention.PagedDecodeAttention` (the CPU kernel)."""

    def supports(self, cache: torch.Tensor) -> bool:
        """Whether this cache (`[blocks, block_size, kv_heads, head_dim]`) is one the kernel
        handles."""
        return (
            cache.device.type == "cuda"
            and cache.dtype in _DTYPES
            and cache.stride(-1) == 1
            and cache.shape[-1] <= MAX_HEAD_DIM
        )

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        num_partitions: int | None = None,
    ) -> torch.Tensor:
        """q `[batch, heads, head_dim]`; caches `[blocks, block_size, kv_heads, head_dim]` (K and V
        with the same strides); `context_lens` >= 1, including the new token; returns q's shape and
        dtype. `num_partitions` (tests) overrides `partitions_for`."""
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError(
                f"K and V caches need equal strides and contiguous rows, got {k_cache.stride()} "
                f"and {v_cache.stride()}"
            )
        q = q if q.stride(-1) == 1 else q.contiguous()
        block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        group_size = num_heads // num_kv_heads
        parts = num_partitions or partitions_for(batch, num_kv_heads, q.device)
        if parts > 1:
            part_out = torch.empty(
                batch, num_heads, parts, head_dim, dtype=torch.float32, device=q.device
            )
            part_max = torch.empty(batch, num_heads, parts, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_out = part_max = part_sum = out  # not read: SPLIT is off
        head_dim_padded = max(_MIN_DOT_ROWS, triton.next_power_of_2(head_dim))
        _paged_decode_kernel[(batch, num_kv_heads, parts)](
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            part_out,
            part_max,
            part_sum,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            group_size,
            head_dim,
            block_size,
            num_heads,
            parts,
            GROUP_ROWS=max(_MIN_DOT_ROWS, triton.next_power_of_2(group_size)),
            HEAD_DIM_PADDED=head_dim_padded,
            TILE_TOKENS=TILE_TOKENS,
            SPLIT=parts > 1,
            FP32_DOT=k_cache.dtype in _FP32_DOT_DTYPES,
        )
        if parts > 1:
            _merge_partitions_kernel[(batch, num_heads)](
                part_out,
                part_max,
                part_sum,
                out,
                out.stride(0),
                out.stride(1),
                num_heads,
                parts,
                head_dim,
                PARTITIONS_PADDED=triton.next_power_of_2(parts),
                HEAD_DIM_PADDED=head_dim_padded,
            )
        return out
