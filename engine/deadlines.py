"""The order of a prefill queue whose prompts carry TTFT deadlines: earliest deadline first among
the prompts that can still make theirs, the late ones after them. The engine's scheduler orders its
waiting prompts by it (`Scheduler.prefill_order`). Torch-free."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional


class Queued(NamedTuple):
    item: Any
    tokens_left: int  # prompt tokens still to compute
    deadline_s: Optional[float]  # when its first token is due; None: no deadline, never late
    arrival_s: float
    begun: bool  # chunks of it computed already (or a stream preempted): it keeps its place


def deadline_order(queued: list[Queued], now_s: float, token_s: float) -> list[Any]:
    """The items in the order their prompts prefill. Begun prompts first, as they were. Then by
    deadline (a prompt without one by its arrival), each reckoned to finish after the ones before it
    at `token_s` seconds per token; a prompt that would finish past its deadline is late and waits
    until no prompt that can still make its deadline is left: it misses its SLO either way, and
    computing it first would make the prompts behind it miss theirs too (under overload, first come
    first served has every prompt miss). Without deadlines: the order given."""
    if all(entry.deadline_s is None for entry in queued):
        return [entry.item for entry in queued]
    begun = [entry for entry in queued if entry.begun]
    done_s = now_s + token_s * sum(entry.tokens_left for entry in begun)
    in_time, late = [], []
    for entry in sorted((entry for entry in queued if not entry.begun), key=_due):
        finish_s = done_s + token_s * entry.tokens_left
        if entry.deadline_s is None or finish_s <= entry.deadline_s:
            in_time.append(entry)
            done_s = finish_s
        else:
            late.append(entry)
    return [entry.item for entry in (*begun, *in_time, *late)]


def _due(entry: Queued) -> float:
    return entry.arrival_s if entry.deadline_s is None else entry.deadline_s
