"""The measured costs of one machine and model (`pdserve profile` writes them, the simulator reads
them).

Every figure is a measurement (pdserve/planner/profiler.py); between and beyond the measured points
the simulator interpolates piecewise-linearly (and extrapolates from the last two points), so a
profile over 128..2048 prompt tokens answers for 3000 with the slope of its longest prompts.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

VERSION = 1


@dataclass(frozen=True)
class PrefillPoint:
    prompt_tokens: int
    threads: int
    seconds: float  # one engine prefill step of this prompt alone, nothing cached


@dataclass(frozen=True)
class ContextPrefillPoint:
    context_tokens: int  # already in the KV (a cached prefix, or the chunks before)
    new_tokens: int
    threads: int
    seconds: float  # one engine step prefilling the new tokens after the context


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    context_tokens: int  # of each sequence in the batch
    threads: int
    seconds: float  # one engine decode step (forward + sampling)


@dataclass(frozen=True)
class HandoffPoint:
    # "ray", "grpc", or "inproc" (export + import in one process: the floor, --quick)
    transport: str
    kv_bytes: int
    seconds: float  # asked to ship until the receiver has it installed and verified


@dataclass(frozen=True)
class ServingCosts:
    """The serving path's own costs beyond the engine steps, fitted on a running system
    (serving_probe.measure_serving): what a request and a decode step cost between the client and
    the engine (the router, Ray calls, the token stream, the client) on the machine the workers
    share, and what a step run on cores borrowed from another worker costs beyond the engine's own
    step."""

    request_s: float  # per request: admission, tokenization, the calls before and after its prefill
    step_s: float  # per decode step: the engine loop's own work and the step's stream item
    token_s: float  # per token of a decode step: its way through the router to the client
    # the calibration runs' measured and engine-only figures, for the record
    fitted_from: dict = field(default_factory=dict)
    # a step on borrowed cores (runtime/cores.py) beyond the engine's step at that thread count:
    # taking the cores and changing torch's thread count for one step, and back; and a prefill's
    # threads waiting on each other where the node's other processes (the router, Ray, the lender)
    # take a core for a moment, which grows with the step: `borrow_prefill_share` of its engine time
    # (fitted since 2026-12-03; earlier profiles hold the whole cost in `borrow_prefill_s`)
    borrow_prefill_s: float = 0.0
    borrow_decode_s: float = 0.0
    borrow_prefill_share: float = 0.0
    # the engine's steps as the serving system ran them in the probe against the profile's, as a
    # share beyond them: the prefill worker's own timing of its lone prefill steps against the
    # profile's prefill, the decode worker's of its steps against the profile's decode steps (the
    # machine's speed then, minutes after the profile, and anything serving adds to a step; since
    # the second session of 2026-12-04, before none)
    prefill_share: float = 0.0
    decode_share: float = 0.0

    def decode_step_s(self, batch_size: int) -> float:
        return self.step_s + batch_size * self.token_s


@dataclass(frozen=True)
class Profile:
    machine: dict  # cpu_model, cpu_capability, cores, torch, model, dtype
    kv_bytes_per_token: int
    # the router's own work per streamed token (profiler.measure_router)
    router_cpu_s_per_token: float
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    handoff: tuple[HandoffPoint, ...]
    version: int = VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)
    # None: the engine alone (a profile without a serving calibration, or --quick)
    serving: Optional[ServingCosts] = None
    # KV tokens one decode worker holds (`pdserve serve`'s default cache); None: unlimited
    kv_capacity_tokens: Optional[int] = None
    # prompt tokens prefilled after a context in the KV; none measured: chunk_s estimates them
    context_prefill: tuple[ContextPrefillPoint, ...] = ()

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("a profile needs prefill and decode points")

    @property
    def cores(self) -> int:
        return int(self.machine.get("cores", 2))

    @property
    def transports(self) -> tuple[str, ...]:
        return tuple(sorted({p.transport for p in self.handoff}))

    # -- costs -----------------------------------------------------------------------------------

    def prefill_s(self, prompt_tokens: int, threads: int = 1) -> float:
        """One prompt of `prompt_tokens` prefilled alone on `threads` (the nearest measured
        count)."""
        if prompt_tokens <= 0:
            return 0.0
        points = [
            p
            for p in self.prefill
            if p.threads == _nearest(threads, {p.threads for p in self.prefill})
        ]
        return max(0.0, _interpolate([(p.prompt_tokens, p.seconds) for p in points], prompt_tokens))

    def chunk_s(self, start_tokens: int, end_tokens: int, threads: int = 1) -> float:
        """Prompt tokens start..end of one sequence, the first `start_tokens` already in its KV: as
        measured (`context_prefill`, bilinear in context and new tokens), else the difference of the
        cumulative cost (so attention over the context before it counts) plus the fixed cost of a
        step (the intercept of the two shortest measured prompts)."""
        if end_tokens <= start_tokens:
            return 0.0
        if start_tokens <= 0:
            return self.prefill_s(end_tokens, threads)
        if self.context_prefill:
            chosen = _nearest(threads, {p.threads for p in self.context_prefill})
            points = [p for p in self.context_prefill if p.threads == chosen]
            per_context = []
            for context in sorted({p.context_tokens for p in points}):
                row = [(p.new_tokens, p.seconds) for p in points if p.context_tokens == context]
                per_context.append((context, _interpolate(row, end_tokens - start_tokens)))
            return max(1e-4, _interpolate(per_context, start_tokens))
        return (
            self.prefill_s(end_tokens, threads)
            - self.prefill_s(start_tokens, threads)
            + self.prefill_fixed_s(threads)
        )

    def prefill_fixed_s(self, threads: int = 1) -> float:
        """A prefill step's cost that does not grow with its tokens (0 with one measured length)."""
        chosen = _nearest(threads, {p.threads for p in self.prefill})
        points = sorted((p.prompt_tokens, p.seconds) for p in self.prefill if p.threads == chosen)
        if len(points) < 2:
            return 0.0
        (x0, y0), (x1, y1) = points[:2]
        return max(0.0, y0 - x0 * (y1 - y0) / (x1 - x0))

    def decode_step_s(self, batch_size: int, context_tokens: float, threads: int = 1) -> float:
        """One decode step of `batch_size` sequences of `context_tokens` each (bilinear in both)."""
        if batch_size <= 0:
            return 0.0
        chosen = _nearest(threads, {p.threads for p in self.decode})
        points = [p for p in self.decode if p.threads == chosen]
        contexts = sorted({p.context_tokens for p in points})
        per_context = []
        for context in contexts:
            row = [(p.batch_size, p.seconds) for p in points if p.context_tokens == context]
            per_context.append((context, _interpolate(row, batch_size)))
        return max(1e-4, _interpolate(per_context, context_tokens))

    def handoff_s(self, kv_bytes: int, transport: str) -> float:
        """Shipping `kv_bytes` over `transport`; ValueError when the profile did not measure it."""
        points = [(p.kv_bytes, p.seconds) for p in self.handoff if p.transport == transport]
        if not points:
            raise ValueError(
                f"the profile has no KV handoff for transport {transport!r} (it has: "
                f"{', '.join(self.transports) or 'none'}); profile it or pass --transport"
            )
        return max(0.0, _interpolate(points, kv_bytes))

    # -- JSON ------------------------------------------------------------------------------------

    def with_serving(self, serving: Optional[ServingCosts]) -> "Profile":
        return replace(self, serving=serving)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if data.get("version") != VERSION:
            raise ValueError(
                f"profile version {data.get('version')!r}; this pdserve reads version {VERSION}"
            )
        return cls(
            machine=dict(data["machine"]),
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            router_cpu_s_per_token=float(data["router_cpu_s_per_token"]),
            prefill=tuple(PrefillPoint(**p) for p in data["prefill"]),
            decode=tuple(DecodePoint(**p) for p in data["decode"]),
            handoff=tuple(HandoffPoint(**p) for p in data["handoff"]),
            notes=tuple(data.get("notes", ())),
            serving=ServingCosts(**data["serving"]) if data.get("serving") else None,
            kv_capacity_tokens=data.get("kv_capacity_tokens"),
            context_prefill=tuple(
                ContextPrefillPoint(**p) for p in data.get("context_prefill", ())
            ),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path}: not a pdserve profile ({error})") from None


def _nearest(wanted: int, available: set[int]) -> int:
    return min(available, key=lambda value: (abs(value - wanted), value))


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through `points` (x, y), extrapolated linearly from the two nearest ends."""
    ordered = sorted(dict(points).items())
    if len(ordered) == 1:
        # one point: proportional
        return ordered[0][1] * (x / ordered[0][0] if ordered[0][0] else 1.0)
    xs = [p[0] for p in ordered]
    index = min(max(bisect.bisect_left(xs, x), 1), len(ordered) - 1)
    (x0, y0), (x1, y1) = ordered[index - 1], ordered[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
