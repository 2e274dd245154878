"""The requests to the workers (Ray actor calls), one frozen dataclass per call; the replies are in
`messages`. A worker method takes exactly one of these, so a call reads by field name, not by
position. Sampling parameters and actor handles travel as they are (typed `Any` here: this package
imports nothing of ours).

Per request, disaggregated, from the router: `ReserveRequest` (decode) -> `PrefillRequest` (prefill;
`RenewRequest` to the decode worker while it waits) and, if the request ends early, `AbortRequest`
to either. The KV handoff then goes worker to worker, not through the router: `AdmitRequest`
(prefill -> decode: the first token, and a routed transport's KV deliveries) -> `AcknowledgeRequest`
(decode -> prefill, routed transports only: grpc acknowledges on its KV stream). Colocated, or
prefilled on its decode worker: `AdmitColocatedRequest` (router -> decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class ReserveRequest:
    """Decode worker: set KV blocks aside for a prompt before its transfer starts. The reply is how
    many leading blocks it reused from its prefix cache (not sent), or None when it has no room."""

    request_id: str
    num_prompt_tokens: int
    timeout_s: float  # the reservation's life, renewed while the prompt waits for prefill
    # the prompt's ids: its cached prefix is reused; None: only its length is known (load routing)
    prompt_ids: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class RenewRequest:
    """Decode worker: restart a reservation's clock (its prompt still waits for prefill)."""

    request_id: str
    timeout_s: float


@dataclass(frozen=True)
class PrefillRequest:
    """Prefill worker: run the prompt, answer with its first token (`messages.PrefillResult`) and
    hand the request to the decode worker that reserved its KV: the KV to `destination` (grpc) or in
    the `AdmitRequest` it sends `decode` itself (ray, rdt; ray by CUDA IPC when `destination` is
    `cuda:<UUID>` of the prefill worker's own GPU)."""

    request_id: str
    prompt_ids: Sequence[int]
    params: Any  # engine.sampling_params.SamplingParams
    # the decode worker's KV address: host:port (grpc), `cuda:<GPU UUID>` (ray on a GPU), or None
    destination: Optional[str]
    skip_blocks: int = 0  # leading prompt blocks the decode worker reused: not sent
    # the decode worker's actor handle: its `admit` is called by the prefill worker, not the router
    decode: Any = None
    # what is left of the SLO's TTFT as the router sends it: the prompt's deadline in the prefill
    # queue (engine/scheduler.py: Scheduler.prefill_order); None: none (a migrated request, whose
    # first token went out before, or `--prefill-order fcfs`)
    ttft_budget_s: Optional[float] = None
    # how the KV goes on the wire (protocol/kv_wire.py: none, lossless, fp8, int8), the router's
    # choice (router/kv_wire.py)
    kv_wire: str = "none"


@dataclass(frozen=True)
class AdmitRequest:
    """Decode worker, from the prefill worker: decode a prompt whose KV it reserved, from its first
    token on."""

    request_id: str
    prompt_ids: Sequence[int]
    first_token_id: int
    params: Any  # engine.sampling_params.SamplingParams
    # a routed transport's KV messages (ray: header + ObjectRef), installed in the same call; ()
    # in-band
    deliveries: tuple[Any, ...] = ()
    # the prefill worker's actor handle, told directly once `deliveries` are installed; None in-band
    acknowledge_to: Any = None


@dataclass(frozen=True)
class AdmitColocatedRequest:
    """Decode (or colocated) worker: prefill and decode a whole request."""

    request_id: str
    prompt_ids: Sequence[int]
    params: Any  # engine.sampling_params.SamplingParams


@dataclass(frozen=True)
class AcknowledgeRequest:
    """Prefill worker, from the decode worker: it installed the request's KV; its blocks may be
    freed."""

    request_id: str


@dataclass(frozen=True)
class AbortRequest:
    """Either worker: forget the request and free whatever it holds for it."""

    request_id: str
