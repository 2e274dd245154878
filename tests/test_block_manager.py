"""The block allocator: never a block handed out twice, every block back on free, prefix reuse."""

import pytest
from hypothesis import given, settings, strategies as st

from engine.block_manager import BlockAllocator, OutOfBlocksError


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "prompt", "free"]), st.integers(0, 6), st.integers(0, 3)
        ),
        max_size=60,
    )
)
def test_random_operations_keep_the_books_straight(ops):
    allocator = BlockAllocator(num_blocks=24, block_size_tokens=4)
    held: list[list[int]] = []  # one entry per live allocation
    prompts = [
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [1, 2, 3, 4, 9, 9, 9, 9, 9, 9],
        [7] * 13,
        [1, 2, 3, 4, 5, 6, 7, 8],
    ]
    for op, count, which in ops:
        try:
            if op == "alloc":
                held.append(allocator.allocate(count))
            elif op == "prompt":
                prompt = prompts[which]
                blocks, cached = allocator.allocate_prompt(prompt)
                assert len(blocks) == allocator.blocks_needed(len(prompt))
                assert cached % 4 == 0 and cached < len(prompt)
                allocator.register_computed(prompt, blocks, len(prompt))
                held.append(blocks)
            elif held:
                allocator.free(held.pop(count % len(held)))
        except OutOfBlocksError:
            pass
        references: dict[int, int] = {}
        for blocks in held:
            assert len(set(blocks)) == len(blocks)  # no block twice within one sequence
            for b in blocks:
                references[b] = references.get(b, 0) + 1
        for b, count_held in references.items():
            assert allocator.ref_count(b) == count_held  # shared only through the prefix cache
        assert allocator.num_free_blocks == allocator.num_blocks - len(references)
    for blocks in held:
        allocator.free(blocks)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_prefix_blocks_are_shared_and_revived_after_free():
    allocator = BlockAllocator(num_blocks=8, block_size_tokens=4)
    first = list(range(10))
    blocks_a, cached_a = allocator.allocate_prompt(first)
    assert cached_a == 0
    allocator.register_computed(first, blocks_a, len(first))
    blocks_b, cached_b = allocator.allocate_prompt(first[:8] + [99, 98])
    assert cached_b == 8 and blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    allocator.free(blocks_a)
    allocator.free(blocks_b)
    assert allocator.num_free_blocks == 8
    blocks_c, cached_c = allocator.allocate_prompt(first)  # revived from the free list
    assert cached_c == 8 and blocks_c[:2] == blocks_a[:2]
    allocator.free(blocks_c)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    allocator = BlockAllocator(num_blocks=8, block_size_tokens=4)
    prompt = list(range(8))
    blocks, _ = allocator.allocate_prompt(prompt)
    allocator.register_computed(prompt, blocks, 8)
    again, cached = allocator.allocate_prompt(prompt)
    assert cached == 4 and again[0] == blocks[0] and again[1] != blocks[1]


def test_out_of_blocks_and_double_free_are_errors():
    allocator = BlockAllocator(num_blocks=2, block_size_tokens=4)
    with pytest.raises(OutOfBlocksError, match="need 3 KV blocks, 2 free"):
        allocator.allocate(3)
    blocks = allocator.allocate(1)
    allocator.free(blocks)
    with pytest.raises(ValueError, match="freed more often"):
        allocator.free(blocks)
