"""What the router counts: requests by outcome, migrations, the SLO, and the recent first tokens and
TPOTs the autoscaler and `GetStats` read; each event also feeds the Prometheus metrics
(router/metrics.py). Outside the router these are read as one `RouterStatsSnapshot`
(`Router.stats`)."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Optional

from router.metrics import RouterMetrics
from router.output import FinalInfo
from router.slo import COUNTED_FINISH_REASONS, SLO

log = logging.getLogger("router.router")

_RECENT_SAMPLES = 512
RECENT_WINDOW_S = 30.0  # what "recent" means for the p50s


@dataclass(frozen=True)
class RouterStatsSnapshot:
    """The router's counts at one moment (`Router.stats`)."""

    requests_in_flight: int  # inside the router: waiting for KV room, prefilling or decoding
    requests_waiting_for_kv: int  # of those, waiting until a decode worker has room
    requests_completed: int
    requests_failed: int  # ended without finishing: rejected, failed or aborted by the client
    migrations: int  # attempts re-run after a worker died under them
    slo_finished: int  # completed requests judged against the SLO
    slo_met: int  # of those, the ones that met both targets
    # medians over the last RECENT_WINDOW_S (None: no sample): TTFT and its queue part, TPOT
    ttft_p50_s: Optional[float]
    queue_p50_s: Optional[float]
    tpot_p50_s: Optional[float]


class RouterStats:
    def __init__(self, metrics: RouterMetrics, slo: SLO):
        self.metrics = metrics
        self.set_slo(slo)
        self.requests_completed = 0
        self.requests_failed = 0
        self.migrations = 0
        self.slo_finished = 0
        self.slo_met = 0
        self.waiting_for_kv = 0  # held by `router.counting.Count` while a request waits
        # (monotonic time, TTFT s, queue s) of recent first tokens; (time, TPOT s) of recent ends
        self._first_tokens: collections.deque = collections.deque(maxlen=_RECENT_SAMPLES)
        self._tpots: collections.deque = collections.deque(maxlen=_RECENT_SAMPLES)

    def set_slo(self, slo: SLO) -> None:
        self.slo = slo
        self.metrics.set_slo(slo)

    def first_token(self, now_s: float, ttft_s: float, queue_s: float) -> None:
        self._first_tokens.append((now_s, ttft_s, queue_s))

    def tpot(self, now_s: float, tpot_s: float) -> None:
        self._tpots.append((now_s, tpot_s))

    def migration(self) -> None:
        self.migrations += 1
        self.metrics.migrations.inc()

    def ended_unfinished(self, outcome: str) -> None:
        """A request ended without its final item: "aborted", "rejected" or "error"."""
        self.requests_failed += 1
        self.metrics.requests.labels(outcome).inc()

    def refused(self, reason: str) -> None:
        """A request refused before it was admitted: "invalid", "unauthorized" or "rejected"."""
        self.metrics.requests.labels(reason).inc()

    def finished(self, final: FinalInfo) -> None:
        self.requests_completed += 1
        self.metrics.observe_finished(final)
        if final.finish_reason in COUNTED_FINISH_REASONS:
            result = self.slo.result(
                final.ttft_s, final.tpot_s if final.completion_tokens > 1 else None
            )
            self.slo_finished += 1
            self.slo_met += result == "met"
            self.metrics.observe_slo(result)
        log.info(
            "finished (%s): %d prompt (%d cached) + %d completion tokens, TTFT %.1f ms (queue "
            "%.1f, prefill %.1f), TPOT %.1f ms, KV %d B (wire %d B, %s) in %.1f ms, prefill %s, "
            "decode %s, PD %s",
            final.finish_reason,
            final.prompt_tokens,
            final.cached_prompt_tokens,
            final.completion_tokens,
            final.ttft_s * 1e3,
            final.queue_s * 1e3,
            final.prefill_s * 1e3,
            final.tpot_s * 1e3,
            final.kv_bytes,
            final.kv_wire_bytes,
            final.kv_wire or "-",
            final.kv_transfer_s * 1e3,
            final.prefill_worker or "-",
            final.decode_worker,
            final.pd_decision or "-",
        )

    def snapshot(self, now_s: float, requests_in_flight: int) -> RouterStatsSnapshot:
        return RouterStatsSnapshot(
            requests_in_flight=requests_in_flight,
            requests_waiting_for_kv=self.waiting_for_kv,
            requests_completed=self.requests_completed,
            requests_failed=self.requests_failed,
            migrations=self.migrations,
            slo_finished=self.slo_finished,
            slo_met=self.slo_met,
            ttft_p50_s=_p50(((t, ttft) for t, ttft, _ in self._first_tokens), now_s),
            queue_p50_s=_p50(((t, queue) for t, _, queue in self._first_tokens), now_s),
            tpot_p50_s=_p50(self._tpots, now_s),
        )


def _p50(samples, now_s: float, window_s: float = RECENT_WINDOW_S) -> Optional[float]:
    """Median of the values of recent (time, value) samples, or None."""
    values = sorted(value for t, value in samples if now_s - t <= window_s)
    return values[len(values) // 2] if values else None
