"""Prefix-aware routing: which worker holds which prompt prefix, and how that weighs against load.

Every worker reports the block hashes its KV cache starts and stops holding
(engine/block_manager.py's hash events): a decode worker with each step of its token stream (and all
it holds when the router subscribes), a prefill worker with each prefill result. `PrefixIndex` keeps
them per worker. A prompt's block hashes (the same chain the engines compute,
protocol/block_hash.py) then tell, for each candidate worker, how many of its leading tokens that
worker would not need to compute (prefill pool) or receive (decode pool).

The index is a guess, never a promise: an event may be late or lost, and a worker's cache may evict
a block right after the router looked. A wrong guess costs time, never correctness: the worker
itself matches the prompt against its cache when the request arrives.

`rank` orders a pool's candidates by an estimate of the work in front of the request, in prompt
tokens:

    prefill pool:  queued prompt tokens + prompt tokens - prefix_weight * cached tokens
    decode pool:   queued prompt tokens + decode_stream_tokens * running requests
                   - prefix_weight * cached tokens

ties going to fewer requests, then more free KV. `policy="load"` ignores caches (the order before
prefix routing: queued prompt tokens, then requests, then free KV).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

from protocol.block_hash import prompt_block_hashes
from router.pools.workers import WorkerHandle

POLICIES = ("prefix", "load")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix"  # "load": pick workers by load alone
    prefix_weight: float = 1.0  # one cached prompt token offsets this many tokens of load
    # decode pool: one running request weighs like this many queued prompt tokens
    decode_stream_tokens: int = 64

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.prefix_weight < 0 or self.decode_stream_tokens < 0:
            raise ValueError("--prefix-weight and --decode-stream-tokens must be >= 0")


class PrefixIndex:
    """Block hash -> the workers holding it. Fed from token-stream threads and the router's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, set[bytes]] = {}  # worker id -> its hashes (to forget a worker)

    def reset(self, worker_id: str, held: Iterable[bytes]) -> None:
        """What a worker holds as of now (its subscription's first message)."""
        self.forget(worker_id)
        self.apply(worker_id, ((True, block_hash) for block_hash in held))

    def apply(self, worker_id: str, events: Iterable[tuple[bool, bytes]]) -> None:
        with self._lock:
            held = self._held.setdefault(worker_id, set())
            for stored, block_hash in events:
                if stored:
                    held.add(block_hash)
                    self._holders.setdefault(block_hash, set()).add(worker_id)
                elif block_hash in held:
                    held.discard(block_hash)
                    holders = self._holders[block_hash]
                    holders.discard(worker_id)
                    if not holders:
                        del self._holders[block_hash]

    def forget(self, worker_id: str) -> None:
        """A worker left: none of its hashes count any more."""
        with self._lock:
            for block_hash in self._held.pop(worker_id, ()):
                holders = self._holders[block_hash]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]

    def cached_blocks(self, hashes: Sequence[bytes], worker_ids: Iterable[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the hash chain it holds."""
        remaining = set(worker_ids)
        matched = dict.fromkeys(remaining, 0)
        with self._lock:
            for index, block_hash in enumerate(hashes):
                remaining &= self._holders.get(block_hash, set())
                if not remaining:
                    break
                for worker_id in remaining:
                    matched[worker_id] = index + 1
        return matched

    def num_hashes(self, worker_id: str) -> int:
        with self._lock:
            return len(self._held.get(worker_id, ()))


@dataclass(frozen=True)
class Candidate:
    worker: WorkerHandle
    cached_tokens: int  # what the index says this worker holds of the prompt


def prompt_hashes(
    config: RoutingConfig, prompt_ids: Sequence[int], block_size_tokens: int
) -> list[bytes]:
    """The prompt's block hashes as the engines chain them; none under load routing."""
    return prompt_block_hashes(prompt_ids, block_size_tokens) if config.policy == "prefix" else []


def rank(
    config: RoutingConfig,
    index: PrefixIndex,
    workers: Sequence[WorkerHandle],
    hashes: Sequence[bytes],
    prompt_tokens: int,
    role: str,
) -> list[Candidate]:
    """`workers` (ready ones of one pool) best first for this prompt; `role`: "prefill" or
    "decode"."""
    if not workers:
        return []
    blocks = index.cached_blocks(hashes, (w.worker_id for w in workers)) if hashes else {}
    candidates = [
        Candidate(w, blocks.get(w.worker_id, 0) * w.info.block_size_tokens) for w in workers
    ]
    if config.policy == "load":
        return sorted(
            candidates,
            key=lambda c: (
                c.worker.queued_prompt_tokens,
                _streams(c.worker),
                -(c.worker.kv_blocks_free or 0),
            ),
        )

    def cost(candidate: Candidate) -> tuple[float, int, int]:
        worker = candidate.worker
        load = worker.queued_prompt_tokens + (
            prompt_tokens if role == "prefill" else config.decode_stream_tokens * _streams(worker)
        )
        return (
            load - config.prefix_weight * candidate.cached_tokens,
            _streams(worker),
            -(worker.kv_blocks_free or 0),
        )

    return sorted(candidates, key=cost)


def _streams(worker: WorkerHandle) -> int:
    """The requests a worker holds or is about to: those routed there, and the KV reservations on
    their way (a burst of requests all ranks before the first reservation returns, and must not all
    land on one)."""
    return worker.in_flight + worker.reserving
