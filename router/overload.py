"""Admission limits: bounded queues instead of unbounded memory growth under overload.

`max_in_flight` caps the requests the router holds at once (running or queued); `max_waiting_for_kv`
caps those queued for KV room on a decode worker. A request beyond either is refused at once with
`OverloadedError` (RESOURCE_EXHAUSTED / HTTP 429 with a retry hint); it never waits unboundedly.
"""

from __future__ import annotations

from dataclasses import dataclass


class OverloadedError(RuntimeError):
    """The router's queues are full; the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionLimits:
    max_in_flight: int = 1024
    max_waiting_for_kv: int = 256

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_waiting_for_kv < 0:
            raise ValueError("max_in_flight must be >= 1 and max_waiting_for_kv >= 0")
