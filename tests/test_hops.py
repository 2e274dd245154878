"""The KV handoff goes worker to worker (issue #31, "fewer hops"): the prefill worker admits the
request on its decode worker and the decode worker acknowledges the KV to it, so neither waits for
the router. Shown on a real system by stalling the router's event loop right after the first token
reached the client: meanwhile the prefill worker's blocks are freed (acknowledged by the decode
worker) and the decode worker runs the request; the output is the same as an undisturbed run's."""

from __future__ import annotations

import time

import pytest

PROMPT = "Rivers shaped where people settled, traded and fought. " * 12
MAX_TOKENS = 24
STALL_S = 4.0


@pytest.fixture(scope="module", params=["ray", "grpc"])
def system(request, harness):
    # a lease far longer than the stall: only an acknowledgement can free the prefill worker's
    # blocks
    running = harness.start(
        mode="disaggregated", transport=request.param, num_prefill=1, num_decode=1, kv_timeout_s=60
    )
    yield running
    running.stop()


def _generate(system, request_id: str, stall_router_s: float = 0.0):
    """The request's tokens; with `stall_router_s`, the router's loop is blocked for that long as
    soon as the first token arrived, and the workers' state sampled meanwhile."""
    import ray

    prefill = system.system.router.prefill_pool.workers[0].actor
    decode = system.system.router.decode_pool.workers[0].actor
    tokens, during_stall = [], []
    with system.client() as client:
        for response in client.stream(
            client.request(
                PROMPT,
                request_id=request_id,
                max_tokens=MAX_TOKENS,
                temperature=0,
                ignore_eos=True,
            )
        ):
            if not tokens and stall_router_s:
                stall_end_s = time.monotonic() + stall_router_s
                system.loop.call_soon_threadsafe(time.sleep, stall_router_s)
                while time.monotonic() < stall_end_s - 0.5:
                    during_stall.append(
                        ray.get([prefill.load.remote(), decode.load.remote()], timeout=10)
                    )
                    time.sleep(0.1)
            tokens += response.token_ids
    return tokens, during_stall


def test_the_handoff_needs_no_router(system):
    reference, _ = _generate(system, "hops-reference")
    tokens, during_stall = _generate(system, "hops-stalled", stall_router_s=STALL_S)
    assert tokens == reference and len(tokens) == MAX_TOKENS
    # while the router could do nothing, the decode worker acknowledged the KV to the prefill worker
    # ...
    prefill_free = [p.kv_blocks_free == p.kv_blocks_total for p, _ in during_stall]
    assert prefill_free and prefill_free[-1], during_stall
    # ... and decoded the request (admitted by the prefill worker, not by the router)
    assert any(d.running_requests == 1 for _, d in during_stall), during_stall
    assert all(w.kv_blocks_free == w.kv_blocks_total for w in system.wait_idle().workers)
