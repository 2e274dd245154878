"""Runs the model over a scheduled batch: builds the flattened inputs and cache addresses, returns
logits."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence as Seq

import torch

from engine.kv_cache import PagedKVCache
from engine.model import ForwardBatch, LlamaModel, PrefillSlice
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size_tokens = kv_cache.layout.block_size_tokens
        self.device = kv_cache.kv.device
        # set by the engine on CUDA (engine.cuda_graphs)
        self.graphs: Optional["DecodeGraphs"] = None

    def _slots(self, block_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.long)
        return (
            table[positions // self.block_size_tokens] * self.block_size_tokens
            + positions % self.block_size_tokens
        )

    def prefill(
        self, seqs: Seq[Sequence], chunk_lens: Seq[int], every_position: Optional[Seq[bool]] = None
    ) -> torch.Tensor:
        """Computes each sequence's next `chunk_len` tokens into the cache.

        Returns logits `[k, vocab]` for the k sequences (in order) whose chunk reaches their last
        token; a sequence marked in `every_position` (prompt logprobs) gets a row for every token of
        its chunk instead, in order.
        """
        input_ids, positions, slots, slices, last_rows = [], [], [], [], []
        start = 0
        for seq, chunk in zip(seqs, chunk_lens):
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk
            pos = torch.arange(begin, end)
            input_ids.append(torch.tensor(seq.token_ids[begin:end], dtype=torch.long))
            positions.append(pos)
            slots.append(self._slots(seq.block_ids, pos))
            num_blocks = -(-end // self.block_size_tokens)
            slices.append(
                PrefillSlice(
                    start,
                    chunk,
                    end,
                    torch.tensor(seq.block_ids[:num_blocks], dtype=torch.long, device=self.device),
                )
            )
            if every_position is not None and every_position[len(slices) - 1]:
                last_rows.extend(range(start, start + chunk))
            elif end == seq.num_tokens:
                last_rows.append(start + chunk - 1)
            start += chunk
        batch = ForwardBatch(
            positions=torch.cat(positions).to(self.device),
            slot_mapping=torch.cat(slots).to(self.device),
            prefill_slices=slices,
            logits_indices=torch.tensor(last_rows, dtype=torch.long, device=self.device),
        )
        return self.model(
            torch.cat(input_ids).to(self.device),
            batch,
            self.kv_cache.k_caches,
            self.kv_cache.v_caches,
        )

    def decode(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """One step for every sequence: feeds its last token, returns logits `[len(seqs),
        vocab]`."""
        positions = torch.tensor([seq.num_tokens - 1 for seq in seqs], dtype=torch.long)
        max_blocks = max(len(seq.block_ids) for seq in seqs)
        # Padding entries point at block 0; the attention mask hides them.
        tables = torch.tensor(
            [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in seqs],
            dtype=torch.long,
        )
        slots = (
            tables.gather(1, (positions // self.block_size_tokens).unsqueeze(1)).squeeze(1)
            * self.block_size_tokens
        )
        slots += positions % self.block_size_tokens
        if self.graphs is not None and self.graphs.fits(*tables.shape):
            input_ids = torch.tensor([seq.last_token_id for seq in seqs], dtype=torch.long)
            return self.graphs.run(input_ids, positions, slots, tables)
        batch = ForwardBatch(
            positions=positions.to(self.device),
            slot_mapping=slots.to(self.device),
            decode_block_tables=tables.to(self.device),
            decode_context_lens=(positions + 1).to(self.device),
        )
        input_ids = torch.tensor(
            [seq.last_token_id for seq in seqs], dtype=torch.long, device=self.device
        )
        return self.model(input_ids, batch, self.kv_cache.k_caches, self.kv_cache.v_caches)
