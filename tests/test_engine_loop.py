"""The engine loop's timing decisions (runtime/engine_loop.py): calls that may run at a layer
boundary of a step under way, and how long a decoding worker's streams can wait for a prefill that
asks for its cores (the TPOT slack). The loop's thread is stopped first, so the test drives the loop
by hand."""

import asyncio
import time

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.weights import load_model
from runtime.cores import CorePolicy, CoreShare
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
