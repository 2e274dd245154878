"""The order of a prefill queue whose prompts carry TTFT deadlines: earliest deadline first among
the prompts that can still make theirs, the late ones after them, but for no longer than half their
TTFT budget past their deadline. The engine's scheduler orders its waiting prompts by it
(`Scheduler.prefill_order`), the planner's simulator its prefill workers'. Torch-free."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

# A late prompt waits behind prompts that can still make their deadlines until it is this many of
# its TTFT budgets past its own deadline (measured: 0.5 against 1, docs/benchmarks-archive.md)
OVERDUE_BUDGETS = 0.5


class Queued(NamedTuple):
    item: Any
    tokens_left: int  # prompt tokens still to compute
    deadline_s: Optional[float]  # when its first token is due; None: no deadline, never late
    arrival_s: float
    begun: bool  # chunks of it computed already (or a stream preempted): it keeps its place


def deadline_order(queued: list[Queued], now_s: float, token_s: float) -> list[Any]:
    """The items in the order their prompts prefill. Begun prompts first, as they were, then the
    overdue ones: past their deadline by half their TTFT budget (deadline less arrival). Then
    by deadline (a prompt without one by its arrival), each reckoned to finish after the ones before
    it at `token_s` seconds per token; a prompt that would finish past its deadline is late and
    waits until no prompt that can still make its deadline is left: it misses its SLO either way,
    and computing it first would make the prompts behind it miss theirs too (under overload, first
    come first served has every prompt miss). Overdue ones bound that wait, and with it the TTFT
    tail (AVX2 EPYC, 0.5 req/s, 4 s budgets: p99 26.6 s unbounded, 16.5 bounded at a whole budget
    past the deadline, 12.4 at half, 14.4 first come first served; docs/benchmarks-archive.md).
    Without deadlines: the order given."""
    if all(entry.deadline_s is None for entry in queued):
        return [entry.item for entry in queued]
    begun, overdue, rest = [], [], []
    for entry in queued:
        (begun if entry.begun else overdue if _overdue(entry, now_s) else rest).append(entry)
    front = begun + sorted(overdue, key=_due)
    done_s = now_s + token_s * sum(entry.tokens_left for entry in front)
    in_time, late = [], []
    for entry in sorted(rest, key=_due):
        finish_s = done_s + token_s * entry.tokens_left
        if entry.deadline_s is None or finish_s <= entry.deadline_s:
            in_time.append(entry)
            done_s = finish_s
        else:
            late.append(entry)
    return [entry.item for entry in (*front, *in_time, *late)]


def _overdue(entry: Queued, now_s: float) -> bool:
    deadline_s = entry.deadline_s
    return deadline_s is not None and now_s > deadline_s + OVERDUE_BUDGETS * (
        deadline_s - entry.arrival_s
    )


def _due(entry: Queued) -> float:
    return entry.arrival_s if entry.deadline_s is None else entry.deadline_s
