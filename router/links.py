"""The links KV crosses, learnt from the handoffs themselves: for each pair of nodes (the prefill
worker's, the decode worker's), how long a handoff of so many bytes takes, as a fixed latency plus
bytes over a bandwidth, fitted to the latest handoffs by least squares.

A handoff's time runs from the prefill worker starting to send its KV to the decode worker having it
installed (`PrefillResult.kv_sent_wall_s` to the token stream's `kv_ready_wall_s`), so it is what a
request really pays on that link: the transport's own costs and the wire's. The PD policy adds the
predicted time to the remote path's (router/pd_policy.py: a slow link sends prompts to prefill on
their decode worker), `/metrics` exports each link (`pdserve_link_*`), and `pdserve status` prints a
line per link. Torch-free; the planner's simulator takes a link of its own (`--link`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

SAMPLES = 32  # the latest handoffs each link's fit reads
# The fit splits latency from bandwidth only where the sizes differ enough (the largest at least
# twice the smallest, and by this much): handoffs of one prompt length, with a few others, gave
# a latency of 123 ms and 3.7 GB/s on a 1 Gbit/s link; bandwidth from the sums is what they say.
_MIN_SPREAD_BYTES = 256 << 10


class LinkKey(NamedTuple):
    sender_node: str
    receiver_node: str


@dataclass(frozen=True)
class LinkEstimate:
    latency_s: float  # what a handoff costs whatever its size
    bandwidth_bytes_per_s: float  # inf: too few large handoffs to tell
    handoffs: int  # seen in all
    last_bytes: int
    last_s: float

    def transfer_s(self, kv_bytes: int) -> float:
        return self.latency_s + kv_bytes / self.bandwidth_bytes_per_s


def kv_bytes_shipped(prompt_tokens: int, held_blocks: int, receiver) -> int:
    """The KV a handoff of a prompt ships to `receiver` (its `WorkerInfo`): the prompt's blocks,
    less the `held_blocks` of it the receiver's cache holds already."""
    blocks = -(-prompt_tokens // receiver.block_size_tokens) - held_blocks
    return max(0, blocks) * receiver.kv_block_bytes


class Links:
    def __init__(self) -> None:
        self._samples: dict[LinkKey, collections.deque] = {}
        self._handoffs: collections.Counter = collections.Counter()
        self._estimates: dict[LinkKey, LinkEstimate] = {}

    def observe(self, sender_node: str, receiver_node: str, kv_bytes: int, seconds: float) -> None:
        """One handoff of `kv_bytes` that took `seconds`."""
        if kv_bytes <= 0 or seconds < 0 or not math.isfinite(seconds):
            return
        key = LinkKey(sender_node, receiver_node)
        samples = self._samples.setdefault(key, collections.deque(maxlen=SAMPLES))
        samples.append((kv_bytes, seconds))
        self._handoffs[key] += 1
        latency_s, bandwidth = _fit(samples)
        self._estimates[key] = LinkEstimate(
            latency_s, bandwidth, self._handoffs[key], kv_bytes, seconds
        )

    def estimate(self, sender_node: str, receiver_node: str) -> Optional[LinkEstimate]:
        return self._estimates.get(LinkKey(sender_node, receiver_node))

    def transfer_s(self, sender_node: str, receiver_node: str, kv_bytes: int) -> float:
        """The predicted time of a handoff of `kv_bytes` on this link; 0 where none was seen yet
        (a link is taken to be free until it shows otherwise)."""
        estimate = self.estimate(sender_node, receiver_node)
        return 0.0 if estimate is None else estimate.transfer_s(kv_bytes)

    def snapshot(self) -> dict[LinkKey, LinkEstimate]:
        return dict(self._estimates)


def _fit(samples) -> tuple[float, float]:
    """(latency, bandwidth) of `seconds = latency + bytes / bandwidth` by least squares over the
    samples; with sizes too alike to tell the two apart, the bandwidth from the sums (no
    latency)."""
    n = len(samples)
    sizes = [b for b, _ in samples]
    mean_b = sum(sizes) / n
    mean_s = sum(s for _, s in samples) / n
    spread = sum((b - mean_b) ** 2 for b in sizes)
    wide = max(sizes) >= 2 * min(sizes) and max(sizes) - min(sizes) >= _MIN_SPREAD_BYTES
    if wide and spread > 0:
        slope = sum((b - mean_b) * (s - mean_s) for b, s in samples) / spread
        latency = mean_s - slope * mean_b
        if slope > 0 and latency >= 0:
            return latency, 1.0 / slope
    total_s = sum(s for _, s in samples)
    return 0.0, (sum(sizes) / total_s if total_s > 0 else math.inf)
