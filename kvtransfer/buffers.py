"""Preallocated, reused byte buffers for staging KV on either end of a transport.

Fresh memory costs 5-40x a copy into touched memory on these machines (page faults dominate), so
every staging buffer is allocated once, touched, and handed out again for the next transfer.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Byte buffers (flat uint8 tensors) handed out by `acquire` and returned by `release`.

    A buffer is owned by whoever acquired it until it is released; the pool keeps every buffer it
    ever made, growing only when no free one is large enough. Thread-safe.
    """

    def __init__(
        self,
        initial_bytes: int = 0,
        count: int = 1,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ):
        """`pin_memory`: page-locked host buffers, for staging the KV of a CUDA cache (fast,
        asynchronous copies)."""
        self._lock = threading.Lock()
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = [
            self._new(initial_bytes) for _ in range(count) if initial_bytes > 0
        ]

    def _new(self, num_bytes: int) -> torch.Tensor:
        buffer = torch.empty(
            num_bytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory
        )
        buffer.fill_(0)  # touch every page now, not during a transfer
        return buffer

    def acquire(self, num_bytes: int) -> torch.Tensor:
        """A buffer of at least `num_bytes`; the caller owns it until `release`."""
        with self._lock:  # by identity: `==` on tensors compares elements
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            if self._free:  # replace the largest too-small buffer rather than keep both
                self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))
        return self._new(num_bytes)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
