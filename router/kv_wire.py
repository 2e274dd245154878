"""Which wire mode a disaggregated request's KV travels in (`--kv-wire`, `--kv-wire-lossy`).

A fixed mode is used as asked. `auto` predicts, for each mode allowed, when the KV would be
installed: encode + the link's latency + wire bytes over its measured bandwidth + decode
(protocol/kv_wire.py's codec costs; router/links.py's estimate of the prefill node -> decode node
link), and takes the soonest; a codec must save at least `MIN_SAVING_S` and `MIN_SAVING_FRACTION`
over `none`, so a fast link or a small prompt stays raw. Lossy modes (fp8, int8) are candidates only
where the user allowed them. The router sends the choice with the prompt (`PrefillRequest.kv_wire`);
the request's final log line and `pdserve_kv_wire_total{mode,reason}` show it and why. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from protocol.kv_wire import CODEC_COSTS, LOSSY_WIRE_MODES, WIRE_MODES

KV_WIRE_CHOICES = ("auto", *WIRE_MODES)
MIN_SAVING_S = 1e-3
MIN_SAVING_FRACTION = 0.1


@dataclass(frozen=True)
class KVWireConfig:
    mode: str = "auto"  # auto, or one of WIRE_MODES
    lossy_ok: bool = False  # fp8 and int8 only where the user allows them

    def __post_init__(self) -> None:
        if self.mode not in KV_WIRE_CHOICES:
            raise ValueError(
                f"--kv-wire must be one of {', '.join(KV_WIRE_CHOICES)}, got {self.mode!r}"
            )
        if self.mode in LOSSY_WIRE_MODES and not self.lossy_ok:
            raise ValueError(f"--kv-wire {self.mode} is lossy: it needs --kv-wire-lossy ok as well")

    @property
    def candidates(self) -> tuple[str, ...]:
        return tuple(m for m in WIRE_MODES if self.lossy_ok or m not in LOSSY_WIRE_MODES)


class WireChoice(NamedTuple):
    mode: str
    # asked (a fixed --kv-wire), faster (auto: the soonest), no_link (auto: the link is not measured
    # yet), no_gain (auto: no codec saves enough)
    reason: str
    predicted_s: Optional[float] = None  # auto: the chosen mode's predicted handoff


def choose(config: KVWireConfig, raw_bytes: int, dtype: str, link) -> WireChoice:
    """The wire mode of a handoff of `raw_bytes` of KV in `dtype` over `link` (a
    router.links.LinkEstimate, None where none was measured yet)."""
    if config.mode != "auto":
        return WireChoice(config.mode, "asked")
    if link is None or raw_bytes <= 0:
        return WireChoice("none", "no_link")
    predicted = {
        mode: predicted_s(mode, dtype, raw_bytes, link)
        for mode in config.candidates
        if (mode, dtype) in CODEC_COSTS
    }
    raw_s = predicted["none"]
    best = min(predicted, key=predicted.get)
    saving_s = raw_s - predicted[best]
    if best == "none" or saving_s < max(MIN_SAVING_S, MIN_SAVING_FRACTION * raw_s):
        return WireChoice("none", "no_gain", raw_s)
    return WireChoice(best, "faster", predicted[best])


def predicted_s(mode: str, dtype: str, raw_bytes: int, link) -> float:
    cost = CODEC_COSTS[(mode, dtype)]
    return cost.codec_s(raw_bytes) + link.transfer_s(int(raw_bytes * cost.wire_ratio))


def codec_s(mode: str, dtype: str, raw_bytes: int) -> float:
    """What encoding and decoding `raw_bytes` cost in `mode` (0 for an unknown pair): taken off a
    handoff's time before the link learns from it, which then sees only the wire."""
    cost = CODEC_COSTS.get((mode, dtype))
    return 0.0 if cost is None else cost.codec_s(raw_bytes)
