"""One mechanism for the counts a request holds for a while: a worker's `in_flight`, `reserving` and
`queued_prompt_tokens`, the router's `waiting_for_kv`. A `Count` adds its amount when made and takes
it back exactly once: at `release()`, or on leaving its `with` block, whichever comes first. A
`QueuedPrompt` is the count of a prompt in a worker's prefill queue, with the deadline it was sent
with."""

from __future__ import annotations

import time
from typing import Optional

from engine.deadlines import Queued  # torch-free


class Count:
    __slots__ = ("_target", "_field", "_amount")

    def __init__(self, target: object, field: str, amount: int = 1):
        self._target, self._field, self._amount = target, field, amount
        setattr(target, field, getattr(target, field) + amount)

    def release(self) -> None:
        """Takes the amount back (once: later calls do nothing)."""
        amount, self._amount = self._amount, 0
        if amount:
            setattr(self._target, self._field, getattr(self._target, self._field) - amount)

    def __enter__(self) -> "Count":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


class QueuedPrompt(Count):
    """A prompt in a worker's prefill queue until its first token: its tokens in the worker's
    `queued_prompt_tokens`, and its entry in `queued_prompts` (tokens, TTFT deadline or None,
    when sent; time.monotonic()), by which the PD policy reckons where a new prompt would stand in
    the worker's deadline order (router/placement.py)."""

    __slots__ = ()

    def __init__(self, worker: object, tokens: int, deadline_s: Optional[float]):
        super().__init__(worker, "queued_prompt_tokens", tokens)
        worker.queued_prompts[self] = Queued(None, tokens, deadline_s, time.monotonic(), False)

    def release(self) -> None:
        super().release()
        self._target.queued_prompts.pop(self, None)
