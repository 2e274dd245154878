"""What the simulated clients send: arrivals at a rate and request lengths, drawn with a fixed seed.

`--workload in=512,out=128,n=200` (the keys below; lengths "A-B" are uniform in [A, B]):
  in, out       prompt and output tokens (out: max_tokens with ignore_eos, as `pdserve bench` sends)
  n             requests
  arrival       poisson (exponential gaps, the default, as `pdserve bench --request-rate`) or fixed
  multi         the share of requests that are a later turn of an earlier conversation: their prompt is
                that turn's prompt and answer plus `turn` new tokens (prefix caching can skip the rest)
  turn          new tokens of a later turn (default 64)
  seed          the random stream (default 0)
The rate is given apart (`--rate`): the planner tries one workload at many rates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import NamedTuple

ARRIVALS = ("poisson", "fixed")


class Request(NamedTuple):
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    conversation: int  # requests of one conversation share its prompt prefix
    # tokens of the conversation before this turn (prompt + answer of the last turn)
    previous_tokens: int


@dataclass(frozen=True)
class Workload:
    input_tokens: tuple[int, int] = (512, 512)
    output_tokens: tuple[int, int] = (128, 128)
    num_requests: int = 200
    arrival: str = "poisson"
    multi_turn_share: float = 0.0
    turn_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name, (low, high) in (("in", self.input_tokens), ("out", self.output_tokens)):
            if not 1 <= low <= high:
                raise ValueError(f"workload {name}: need 1 <= A <= B, got {low}-{high}")
        if self.num_requests < 1:
            raise ValueError(f"workload n must be >= 1, got {self.num_requests}")
        if self.arrival not in ARRIVALS:
            raise ValueError(
                f"workload arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}"
            )
        if not 0.0 <= self.multi_turn_share < 1.0:
            raise ValueError(f"workload multi must be in [0, 1), got {self.multi_turn_share}")

    @classmethod
    def parse(cls, text: str) -> "Workload":
        """`key=value,...` (see the module's docstring); ValueError naming the part that is wrong."""
        fields: dict = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = part.partition("=")
            try:
                if key in ("in", "out"):
                    low, _, high = value.partition("-")
                    fields["input_tokens" if key == "in" else "output_tokens"] = (
                        int(low),
                        int(high or low),
                    )
                elif key == "n":
                    fields["num_requests"] = int(value)
                elif key == "arrival":
                    fields["arrival"] = value
                elif key == "multi":
                    fields["multi_turn_share"] = float(value)
                elif key == "turn":
                    fields["turn_tokens"] = int(value)
                elif key == "seed":
                    fields["seed"] = int(value)
                else:
                    raise KeyError(key)
            except (KeyError, ValueError):
                raise ValueError(
                    f"workload part {part!r}: expected in=N[-M], out=N[-M], n=N, arrival=poisson|fixed, "
                    "multi=SHARE, turn=N or seed=N"
                ) from None
        return cls(**fields)

    def with_seed(self, seed: int) -> "Workload":
        return replace(self, seed=seed)

    def requests(self, rate_rps: float) -> list[Request]:
        """`num_requests` requests arriving at `rate_rps` on average, from time 0."""
        if not rate_rps > 0:
            raise ValueError(f"rate must be positive, got {rate_rps}")
        draw = random.Random(self.seed)
        requests: list[Request] = []
        now_s = 0.0
        for index in range(self.num_requests):
            now_s += draw.expovariate(rate_rps) if self.arrival == "poisson" else 1.0 / rate_rps
            output = draw.randint(*self.output_tokens)
            if requests and draw.random() < self.multi_turn_share:
                last = draw.choice(requests)
                previous = last.prompt_tokens + last.output_tokens
                requests.append(
                    Request(now_s, previous + self.turn_tokens, output, last.conversation, previous)
                )
            else:
                requests.append(Request(now_s, draw.randint(*self.input_tokens), output, index, 0))
        return requests
