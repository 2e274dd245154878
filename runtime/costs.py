"""A worker's step costs as it measures them: seconds per prompt token of its prefill steps and the
length of its decode steps, each a moving average of the latest steps (so they follow the cores it
has now: a borrowed core, a node grown busy). They travel to the router as `WorkerCosts`, which
decides by them where a prompt prefills (router/pd_policy.py); the planner's simulator keeps a meter
per simulated worker the same way. Torch-free."""

from __future__ import annotations

import math
from typing import Optional

from protocol.messages import WorkerCosts

# The newest step's weight in each average: about the last five steps count
NEWEST_STEP_WEIGHT = 0.3


class CostMeter:
    def __init__(self, interleave_tokens: Optional[int] = None):
        self.interleave_tokens = interleave_tokens
        # averages of prefill steps' seconds and their prompt tokens, kept apart so that the rate
        # weighs each step by its tokens (a short prompt's fixed costs do not pass for a slow core)
        self._prefill_s: Optional[float] = None
        self._prefill_tokens = 0.0
        self.decode_step_s: Optional[float] = None

    def prefill_step(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        if self._prefill_s is None:
            self._prefill_s, self._prefill_tokens = seconds, float(tokens)
            return
        self._prefill_s = _averaged(self._prefill_s, seconds)
        self._prefill_tokens = _averaged(self._prefill_tokens, tokens)

    def decode_step(self, seconds: float) -> None:
        self.decode_step_s = (
            seconds if self.decode_step_s is None else _averaged(self.decode_step_s, seconds)
        )

    @property
    def prefill_token_s(self) -> Optional[float]:
        return None if self._prefill_s is None else self._prefill_s / self._prefill_tokens

    def costs(self, decode_slack_s: float = math.inf) -> WorkerCosts:
        return WorkerCosts(
            self.prefill_token_s, self.decode_step_s, decode_slack_s, self.interleave_tokens
        )


def _averaged(average: float, newest: float) -> float:
    return average + NEWEST_STEP_WEIGHT * (newest - average)
