"""The chained hashes of KV blocks: how the engines name a full block of prompt tokens in their
prefix caches (engine/block_manager.py), the names their hash events report, and how the router
computes a prompt's to look them up in its index of which worker holds which prefix
(router/kv_index.py). Both sides must chain them identically, so the rule is here, where both may
import it.

A block's hash covers its own token ids and, through its predecessor's hash, every token before it:
two prompts share a block's hash exactly when they share the whole prefix up to its end.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

NO_PARENT = b""  # the predecessor's hash of a sequence's first block


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a block holding `token_ids` after the block hashed `parent`."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size_tokens: int) -> list[bytes]:
    """The chained hashes of a prompt's blocks that a cache could serve: its full blocks, short of
    the last token (whose logits must be computed)."""
    hashes, parent = [], NO_PARENT
    for index in range((len(prompt_token_ids) - 1) // block_size_tokens):
        parent = chain_hash(
            parent, prompt_token_ids[index * block_size_tokens : (index + 1) * block_size_tokens]
        )
        hashes.append(parent)
    return hashes
