"""The engine loop's timing decisions (runtime/engine_loop.py): calls that may run at a layer
boundary of a step under way, how long a decoding worker's streams can wait for a prefill that
asks for its cores (the TPOT slack), and the step costs it reports for the PD policy. The loop's
thread is stopped first, so the test drives the loop by hand."""

import asyncio
import math
import threading
import time

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.weights import load_model
from protocol.messages import WorkerCosts
from runtime.cores import CorePolicy, CoreShare
from runtime.costs import NEWEST_STEP_WEIGHT, CostMeter
from runtime.engine_loop import EngineLoop


@pytest.fixture
def stopped_loop(tmp_path):
    def make(tpot_budget_s=None):
        engine = LLMEngine(
            EngineConfig(model="dummy:tiny", block_size_tokens=8),
            loaded=load_model("dummy:tiny", torch.float32),
        )
        cores = CoreShare(
            CorePolicy("all", str(tmp_path), tpot_budget_s=tpot_budget_s), 1, lambda n: None, 2
        )
        loop = EngineLoop(engine, cores=cores)
        loop._stopped = True
        loop._wake.set()
        loop._thread.join(5)
        made.append(cores)
        return loop

    made = []
    yield make
    for cores in made:
        cores.close()


def test_a_mid_step_call_runs_at_a_layer_boundary_and_a_plain_one_waits_for_the_step_to_end(
    stopped_loop,
):
    loop = stopped_loop()
    loop.engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0))
    ran = []

    async def scenario():
        mid = loop.call(lambda: ran.append("mid") or "reserved", mid_step=True)
        plain = loop.call(lambda: ran.append("plain"))
        batch = loop.engine.scheduler.schedule()
        with loop._compute(batch) as between_layers:
            between_layers()  # a layer boundary of the step under way
            assert ran == ["mid"]
        loop._between_steps()  # the step ended
        assert ran == ["mid", "plain"]
        return await mid, await plain

    assert asyncio.run(scenario()) == ("reserved", None)


def test_the_slack_is_what_the_youngest_stream_can_spare_and_none_with_prompt_work_or_no_budget(
    stopped_loop,
):
    assert stopped_loop()._decode_slack_s() is None  # no budget given
    loop = stopped_loop(tpot_budget_s=0.05)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    loop.engine.add_request("a", list(range(1, 20)), params)
    assert loop._decode_slack_s() is None  # a prompt waits: the worker has prompt work of its own
    while loop.engine.scheduler.waiting or not loop.decode_steps:
        loop._step()
    seq = loop.engine.scheduler.running[0]
    step_s = loop.decode_steps_s / loop.decode_steps
    seq.arrival_time_s = time.monotonic() - 0.010  # started decoding 10 ms ago
    tokens = len(seq.output_token_ids)
    final = min(100, tokens + 64)
    expected = loop.cores.policy.tpot_share * 0.05 * final - 0.010 - (final - tokens + 1) * step_s
    assert loop._decode_slack_s() == pytest.approx(expected, abs=0.005)
    seq.arrival_time_s = time.monotonic() - 10  # far behind its budget: it misses whatever happens
    assert loop._decode_slack_s() is None


def _decoding(loop):
    """The loop's engine decoding one fresh stream (slack to lend), its home cores held."""
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    loop.engine.add_request("a", list(range(1, 20)), params)
    while loop.engine.scheduler.waiting or not loop.decode_steps:
        loop._step()
    loop.engine.scheduler.running[0].arrival_time_s = time.monotonic()
    loop.cores.busy()


def _take_lent_core(prefill, between_layers):
    deadline = time.monotonic() + 5
    while prefill.threads == 1:
        assert time.monotonic() < deadline, "the lent core was never taken"
        time.sleep(0.002)
        between_layers()


def test_a_decode_step_lends_its_cores_at_a_layer_boundary_and_its_time_leaves_the_pause_out(
    stopped_loop, tmp_path
):
    """A prefill that asks for a decoding worker's cores mid-step gets them at the step's next layer
    boundary, not at its end; the pause is not the step's compute time (the mean decode step the
    slack is worked out from)."""
    loop = stopped_loop(tpot_budget_s=0.5)  # pauses up to 2 s: the test's own stalls fit
    _decoding(loop)
    prefill = CoreShare(CorePolicy("all", str(tmp_path), tpot_budget_s=0.5), 1, lambda n: None, 2)
    try:
        with prefill.step(is_prefill=True) as between_layers:
            started = time.monotonic()
            stepping = threading.Thread(target=loop._step)
            stepping.start()
            _take_lent_core(prefill, between_layers)
            time.sleep(0.2)  # the prefill computes on both cores
        stepping.join(5)
        wall_s = time.monotonic() - started
    finally:
        prefill.close()
    assert not stepping.is_alive()
    assert loop.cores.lent_pauses == 1 and loop.cores.lent_pauses_s >= 0.2
    assert loop.last_step_s < wall_s - 0.2


def test_a_decoding_worker_decides_on_lending_once_per_token(stopped_loop, tmp_path):
    """No gap between two tokens is longer than one pause and one step: a prefill asking again
    within the same decode step gets nothing until the step's token is out."""
    loop = stopped_loop(tpot_budget_s=0.5)
    _decoding(loop)
    prefill = CoreShare(CorePolicy("all", str(tmp_path), tpot_budget_s=0.5), 1, lambda n: None, 2)
    try:
        with loop._compute(loop.engine.scheduler.schedule()) as decode_layers:
            with prefill.step(is_prefill=True) as between_layers:
                lending = threading.Thread(target=decode_layers)
                lending.start()
                _take_lent_core(prefill, between_layers)
            lending.join(5)  # nobody asks any more: the pause ended
            assert not lending.is_alive() and loop.cores.lent_pauses == 1
            with prefill.step(is_prefill=True):
                assert loop.cores.asked()
                decode_layers()  # the same step: no second pause
                assert loop.cores.lent_pauses == 1
    finally:
        prefill.close()


def test_the_costs_follow_the_recent_steps_and_the_slack_is_reckoned_without_lending():
    """What the router's PD policy reads (`EngineLoop.costs`): seconds per prompt token, the recent
    decode step, and the decoding streams' slack at that step, on a worker that lends no cores (a
    GPU's, or with lending off) too."""
    engine = LLMEngine(
        EngineConfig(model="dummy:tiny", block_size_tokens=8, decode_interleave_tokens=16),
        loaded=load_model("dummy:tiny", torch.float32),
    )
    loop = EngineLoop(engine, core_policy=CorePolicy(tpot_budget_s=0.05))
    loop._stopped = True
    loop._wake.set()
    loop._thread.join(5)
    assert loop.costs == WorkerCosts(interleave_tokens=16)  # nothing measured, nothing decodes
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(1, 20)), params)
    loop._step()  # the prompt: 19 tokens
    assert loop.costs.prefill_token_s == pytest.approx(loop.last_step_s / 19)
    assert loop.costs.decode_step_s is None and loop.costs.decode_slack_s == 0.0
    for _ in range(3):
        loop._step()
    step_s = loop.costs.decode_step_s
    assert step_s is not None and loop.costs.decode_slack_s > 0
    seq = engine.scheduler.running[0]
    tokens = len(seq.output_token_ids)
    final = min(100, tokens + 64)
    needed_s = time.monotonic() - seq.arrival_time_s + (final - tokens + 1) * step_s
    expected = CorePolicy().tpot_share * 0.05 * final - needed_s
    assert loop.costs.decode_slack_s == pytest.approx(expected, abs=0.005)
    engine.abort("a")
    loop._measure()
    assert loop.costs.decode_slack_s == math.inf  # nothing decodes: no stream to wait
    loop.stop()


def test_the_cost_meter_weighs_prefill_steps_by_their_tokens():
    meter = CostMeter()
    meter.prefill_step(512, 0.512)
    assert meter.prefill_token_s == pytest.approx(0.001)
    # a short prompt's fixed cost (30 ms for 4 tokens) hardly moves the rate per token
    meter.prefill_step(4, 0.030)
    assert meter.prefill_token_s == pytest.approx(0.001, rel=0.1)
    # a slower core moves it over a few steps
    for _ in range(5):
        meter.prefill_step(512, 1.024)
    assert meter.prefill_token_s == pytest.approx(0.002, rel=0.2)
    meter.decode_step(0.02)
    meter.decode_step(0.04)
    assert meter.decode_step_s == pytest.approx(0.02 + NEWEST_STEP_WEIGHT * 0.02)
