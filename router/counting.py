"""One mechanism for the counts a request holds for a while: a worker's `in_flight`, `reserving` and
`queued_prompt_tokens`, the router's `waiting_for_kv`. A `Count` adds its amount when made and takes
it back exactly once: at `release()`, or on leaving its `with` block, whichever comes first."""

from __future__ import annotations


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
