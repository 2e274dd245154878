"""The KV block allocator: reference counts, a free list, and prefix caching by chained block
hashes.

A block holds `block_size_tokens` consecutive tokens of one sequence. A *full* block whose KV has
been computed gets a hash chained from its predecessor's hash and its own token ids
(protocol/block_hash.py, which the router's prefix index computes too), so two prompts that share a
prefix share its blocks (each holder counts one reference). A block whose last reference is dropped
goes back to the free list but keeps its hash: until it is handed out again, a later prompt with the
same prefix revives it instead of recomputing it.

With `track_events()`, the allocator also logs each hash it starts and stops holding (a block's hash
is forgotten when the block is handed out again): a worker forwards that log to the router, whose
index of which worker holds which prefix it feeds (router/kv_index.py).
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

from protocol.block_hash import NO_PARENT, chain_hash, prompt_block_hashes


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks for the request; the caller may wait, preempt or reject."""


# A hash event: (True, hash) the allocator now holds a block with this hash; (False, hash) it no
# longer does.
KVEvent = tuple[bool, bytes]
# beyond this, the oldest are dropped: the router's index may then guess wrong
_MAX_PENDING_EVENTS = 1 << 16


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size_tokens: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size_tokens < 1:
            raise ValueError(
                f"need at least one block of one token, got {num_blocks} x {block_size_tokens}"
            )
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Insertion-ordered set: oldest freed first, so cached blocks survive as long as possible.
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._block_hash: list[Optional[bytes]] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._events: Optional[collections.deque] = None  # see `track_events`

    def track_events(self) -> list[bytes]:
        """Starts (or restarts) the hash-event log; returns the hashes held now, from which the
        events continue. Owner thread only; `drain_events` may then run on any thread."""
        self._events = collections.deque(maxlen=_MAX_PENDING_EVENTS)
        return list(self._hash_to_block)

    def drain_events(self) -> list[KVEvent]:
        """The hash events logged since the last drain, oldest first (thread-safe against the
        owner)."""
        events = self._events
        if events is None:
            return []
        drained = []
        while events:
            try:
                drained.append(events.popleft())
            except IndexError:
                break
        return drained

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size_tokens)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Fresh blocks (reference count 1) for KV that has yet to be written."""
        if num_blocks > len(self._free):
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {len(self._free)} free of {self.num_blocks}"
            )
        blocks = []
        for _ in range(num_blocks):
            block_id = next(iter(self._free))
            del self._free[block_id]
            self._forget_hash(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def allocate_prompt(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Blocks for a whole prompt, reusing cached prefix blocks; returns (block ids, cached
        tokens).

        At least the prompt's last token is always left uncached: its logits are needed.
        """
        size = self.block_size_tokens
        cached: list[int] = []
        if self.enable_prefix_caching:
            for block_hash in prompt_block_hashes(prompt_token_ids, size):
                block_id = self._hash_to_block.get(block_hash)
                if block_id is None:
                    break
                cached.append(block_id)
        fresh_needed = self.blocks_needed(len(prompt_token_ids)) - len(cached)
        revived = sum(1 for b in cached if self._ref_counts[b] == 0)
        if fresh_needed + revived > len(self._free):
            raise OutOfBlocksError(
                f"prompt of {len(prompt_token_ids)} tokens needs {fresh_needed + revived} KV "
                f"blocks, {len(self._free)} free of {self.num_blocks}"
            )
        for block_id in cached:
            self._ref_counts[block_id] += 1
            self._free.pop(block_id, None)
        return cached + self.allocate(fresh_needed), len(cached) * size

    def register_computed(
        self, token_ids: Sequence[int], block_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Make a sequence's full, computed blocks findable by later prompts with the same
        prefix."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size_tokens
        parent = NO_PARENT
        for index in range(num_computed_tokens // size):
            parent = chain_hash(parent, token_ids[index * size : (index + 1) * size])
            block_id = block_ids[index]
            if self._block_hash[block_id] is None and parent not in self._hash_to_block:
                self._block_hash[block_id] = parent
                self._hash_to_block[parent] = block_id
                if self._events is not None:
                    self._events.append((True, parent))

    def free(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"KV block {block_id} freed more often than allocated")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            self._block_hash[block_id] = None
            if self._hash_to_block.get(block_hash) == block_id:
                del self._hash_to_block[block_hash]
                if self._events is not None:
                    self._events.append((False, block_hash))
