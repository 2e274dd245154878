"""What the simulated clients send: arrivals at a rate and request lengths, drawn with a fixed seed.

`--workload in=512,out=128,n=200` (the keys below; lengths "A-B" are uniform in [A, B]):
  in, out       prompt and output tokens (out: max_tokens with ignore_eos, as `pdserve bench` sends)
  n             requests
  arrival       poisson (exponential gaps, the default, as `pdserve bench --request-rate`), fixed,
                or bench: the very arrivals (and think times) `pdserve bench --seed SEED` sends at
                its first rate (its k-th rate of a sweep: seed=SEED+k); the lengths are still drawn
                here
  multi         the share of requests that are a later turn of an earlier conversation: their prompt
                is that turn's prompt and answer plus `turn` new tokens (prefix caching can skip the
                rest)
  turn          new tokens of a later turn (default 64)
  seed          the random stream (default 0)
Or conversations, as `pdserve bench --dataset conversation` sends them (`users` > 0):
  users         chats, started at the rate (users/s, Poisson), each of `turns` turns
  turns         user messages per chat (default 4)
  system        tokens of the system prompt every chat shares (default 256)
  turn          tokens of each user message; out: tokens of each reply
  think         mean of the exponential pause between a reply's end and the next turn (s, default 0)
  template      the chat template's tokens per message (default 5; + 4 for the reply's header)
  A turn's prompt is the whole history: system, every earlier message and reply, the new message.
  Its arrival is not drawn: the simulator sends it `think` after the reply before it ends.
The rate is given apart (`--rate`): the planner tries one workload at many rates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

ARRIVALS = ("poisson", "fixed", "bench")


class Request(NamedTuple):
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    conversation: int  # requests of one conversation share its prompt prefix
    # tokens of the conversation before this turn (prompt + answer of the last turn)
    previous_tokens: int
    shared_prefix_tokens: int = 0  # leading tokens every conversation shares (a system prompt)
    # a later turn of a chat: the index of the request whose reply it waits for, and the pause after
    follows: Optional[int] = None
    think_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    input_tokens: tuple[int, int] = (512, 512)
    output_tokens: tuple[int, int] = (128, 128)
    num_requests: int = 200
    arrival: str = "poisson"
    multi_turn_share: float = 0.0
    turn_tokens: int = 64
    seed: int = 0
    users: int = 0  # > 0: conversations (see the module's docstring) instead of independent prompts
    turns: int = 4
    system_tokens: int = 256
    think_s: float = 0.0
    template_tokens: int = 5

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
        if self.users < 0 or self.turns < 1 or self.system_tokens < 0 or self.think_s < 0:
            raise ValueError("workload users, system, think must be >= 0 and turns >= 1")

    @classmethod
    def parse(cls, text: str) -> "Workload":
        """`key=value,...` (see the module's docstring); ValueError naming the part that is
        wrong."""
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
                elif key in ("users", "turns", "system", "template"):
                    name = {"system": "system_tokens", "template": "template_tokens"}.get(key, key)
                    fields[name] = int(value)
                elif key == "think":
                    fields["think_s"] = float(value)
                else:
                    raise KeyError(key)
            except (KeyError, ValueError):
                raise ValueError(
                    f"workload part {part!r}: expected in=N[-M], out=N[-M], n=N, "
                    "arrival=poisson|fixed, "
                    "multi=SHARE, turn=N, seed=N, users=N, turns=N, system=N, think=S or template=N"
                ) from None
        return cls(**fields)

    def with_seed(self, seed: int) -> "Workload":
        return replace(self, seed=seed)

    def requests(self, rate_rps: float) -> list[Request]:
        """`num_requests` requests arriving at `rate_rps` on average, from time 0."""
        if not rate_rps > 0:
            raise ValueError(f"rate must be positive, got {rate_rps}")
        if self.users:
            return self._conversations(rate_rps)
        draw = random.Random(self.seed)
        requests: list[Request] = []
        arrivals_s = self._arrivals_s(self.num_requests, rate_rps, draw)
        for index, now_s in enumerate(arrivals_s):
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

    def _conversations(self, rate_rps: float) -> list[Request]:
        """Every chat's turns in order; a later turn `follows` the one before (its arrival_s is the
        chat's start, replaced by the simulator once the reply before it ends)."""
        draw = random.Random(self.seed)
        message = self.template_tokens
        requests: list[Request] = []
        for user, start_s in enumerate(self._arrivals_s(self.users, rate_rps, draw)):
            thinks_s = self._think_times_s(user, draw)
            history = self.system_tokens + message if self.system_tokens else 0
            previous: Optional[int] = None
            for _ in range(self.turns):
                output = draw.randint(*self.output_tokens)
                prompt = history + self.turn_tokens + message + 4  # + the reply's header
                think = thinks_s.pop(0) if previous is not None else 0.0
                requests.append(
                    Request(
                        start_s,
                        prompt,
                        output,
                        user,
                        history if previous is not None else 0,
                        shared_prefix_tokens=self.system_tokens,
                        follows=previous,
                        think_s=think,
                    )
                )
                previous = len(requests) - 1
                history = prompt + output + message - 4
        return requests

    def _arrivals_s(self, count: int, rate_rps: float, draw: random.Random) -> list[float]:
        if self.arrival == "bench":
            from pdserve.bench import arrival_times_s  # the client's own draw (numpy, no torch)

            return arrival_times_s(count, rate_rps, 1.0, self.seed)
        arrivals_s, now_s = [], 0.0
        for _ in range(count):
            now_s += draw.expovariate(rate_rps) if self.arrival == "poisson" else 1.0 / rate_rps
            arrivals_s.append(now_s)
        return arrivals_s

    def _think_times_s(self, user: int, draw: random.Random) -> list[float]:
        """The pauses before turns 2.. of `user`'s chat."""
        if not self.think_s:
            return [0.0] * (self.turns - 1)
        if self.arrival == "bench":  # as pdserve.bench.conversations draws them
            import numpy as np

            rng = np.random.default_rng([self.seed, user])
            return rng.exponential(self.think_s, self.turns - 1).tolist()
        return [draw.expovariate(1.0 / self.think_s) for _ in range(self.turns - 1)]
