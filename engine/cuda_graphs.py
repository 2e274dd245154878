"""Decode steps replayed from CUDA graphs.

A decode step launches about a dozen kernels per layer from Python, each tiny at small batches, so
the GPU waits on the CPU: one stream of the 8B shape spends most of its step launching. As vLLM and
SGLang do, the step is captured once per batch size in `BATCH_SIZES` (up to the engine's
`max_num_seqs`), a batch is padded up to the next captured size, and a step is one replay.

A graph reads its inputs from fixed buffers: token ids, positions, cache slots, block tables (as
wide as the longest sequence the engine serves) and context lengths, all on the device; the paged
decode kernel splits contexts by batch size alone (engine.triton_paged_attention), so one graph
serves every length. Padding rows write their K/V to a sink block the allocator never hands out,
attend to one token of block 0 (finite, whoever owns it) and their logits are dropped.

CUDA only, and only where the decode attention is the paged kernel (the gather + SDPA fallback sizes
its tensors by the batch's longest context). Prefill stays eager: its shapes vary with every batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from engine.kv_cache import PagedKVCache
from engine.model import ForwardBatch, LlamaModel

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        max_batch: int,
        max_blocks_per_seq: int,
        sink_block: int,
    ):
        device = kv_cache.kv.device
        self.sizes = sorted({size for size in BATCH_SIZES if size < max_batch} | {max_batch})
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sink_slot = sink_block * kv_cache.layout.block_size_tokens
        longest = self.sizes[-1]
        self.input_ids = torch.zeros(longest, dtype=torch.long, device=device)
        self.positions = torch.zeros(longest, dtype=torch.long, device=device)
        self.slots = torch.full((longest,), self.sink_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(longest, max_blocks_per_seq, dtype=torch.long, device=device)
        self.context_lens = torch.ones(longest, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._capture(model, kv_cache)

    def _forward(self, model: LlamaModel, kv_cache: PagedKVCache, size: int) -> torch.Tensor:
        batch = ForwardBatch(
            positions=self.positions[:size],
            slot_mapping=self.slots[:size],
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.context_lens[:size],
        )
        return model(self.input_ids[:size], batch, kv_cache.k_caches, kv_cache.v_caches)

    def _capture(self, model: LlamaModel, kv_cache: PagedKVCache) -> None:
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), as torch's docs ask;
        # every row writes to the sink and reads block 0, so no sequence's KV is touched.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in self.sizes:
                self._forward(model, kv_cache, size)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        # largest first: the smaller graphs fit in its memory pool
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(model, kv_cache, size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int, table_width: int) -> bool:
        return batch <= self.sizes[-1] and table_width <= self.max_blocks_per_seq

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[batch, vocab]` of one decode step; the arguments are the eager step's CPU
        tensors."""
        batch, width = tables.shape
        size = next(s for s in self.sizes if s >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(slots)
        self.slots[batch:size].fill_(self.sink_slot)
        self.tables[:batch, :width].copy_(tables)  # columns past `width` are stale and never read
        self.context_lens[:batch].copy_(positions + 1)
        self.context_lens[batch:size].fill_(1)
        self._graphs[size].replay()
        return self._logits[size][:batch]


def decode_graphs_for(
    model: LlamaModel, kv_cache: PagedKVCache, max_batch: int, max_model_len: int, sink_block: int
) -> Optional[DecodeGraphs]:
    """Graphs for this engine's decode steps, or None where they do not apply (not CUDA, no paged
    kernel)."""
    kernel = model.layers[0].self_attn.decode_kernel
    if (
        kv_cache.kv.device.type != "cuda"
        or kernel is None
        or not kernel.supports(kv_cache.k_caches[0])
    ):
        return None
    block_size = kv_cache.layout.block_size_tokens
    return DecodeGraphs(model, kv_cache, max_batch, -(-max_model_len // block_size), sink_block)
