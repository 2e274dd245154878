"""What the planner's model gained after its first validation (issue #30): the serving path's costs
fitted on a running system, KV capacity, conversations whose turns follow the replies, the client's
own arrivals, a GPU profile from the stored GPU check, and the validation table. No Ray, no server:
the fit is checked on figures given to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.planner.profile import Profile, ServingCosts
from pdserve.planner.serving_probe import PROBE_SHAPE, closed_loop, fit
from pdserve.planner.shape import SystemShape
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import Request, Workload
from router.slo import SLO
from tests.test_planner import synthetic_profile

SLO_LOOSE = SLO.parse("ttft:5000,tpot:500")
ROOT = Path(__file__).resolve().parent.parent


def _probe_loads(profile):
    """The probe's shape (--lend-cores off) and the simulator's figures for its two loads on the
    engine alone: one request at a time (5), four at a time (8)."""
    probed = SystemShape.parse(PROBE_SHAPE, lend_cores=False)
    return (
        probed,
        simulate(profile, probed, SLO_LOOSE, closed_loop(5, 1)),
        simulate(profile, probed, SLO_LOOSE, closed_loop(8, 4)),
    )


def _resimulated(profile, serving, probed):
    """The probe's two loads simulated again with the fitted costs: (one at a time, four at a
    time)."""
    fitted = profile.with_serving(serving)
    return (
        simulate(fitted, probed, SLO_LOOSE, closed_loop(5, 1)),
        simulate(fitted, probed, SLO_LOOSE, closed_loop(8, 4)),
    )


def test_serving_costs_fitted_reproduce_the_loads_they_were_fitted_on():
    """Given a lone request's TTFT/TPOT and a batch of 4's TPOT, the fitted costs make the simulator
    predict exactly those figures for those loads, and each cost lands where it belongs."""
    profile = synthetic_profile()
    probed, engine_lone, engine_batch = _probe_loads(profile)
    lone = {
        "p50_ttft_ms": engine_lone.ttft_ms["p50"] + 40.0,
        "p50_tpot_ms": engine_lone.tpot_ms["p50"] + 5.0,
    }
    batch = {
        "p50_ttft_ms": engine_batch.ttft_ms["p50"] + 40.0,
        "p50_tpot_ms": engine_batch.tpot_ms["p50"] + 5.0 + 3 * 0.5,
    }
    serving = fit(profile, lone, batch, 5, 4)
    assert serving.request_s == pytest.approx(0.040, abs=1e-3)
    assert serving.token_s == pytest.approx(0.0005, abs=1e-4)
    assert serving.step_s == pytest.approx(0.0045, abs=3e-4)
    again_lone, again_batch = _resimulated(profile, serving, probed)
    assert again_lone.ttft_ms["p50"] == pytest.approx(lone["p50_ttft_ms"], rel=0.01)
    assert again_lone.tpot_ms["p50"] == pytest.approx(lone["p50_tpot_ms"], rel=0.02)
    # a first-order fit: the costs also move the second wave's arrivals a little
    assert again_batch.tpot_ms["p50"] == pytest.approx(batch["p50_tpot_ms"], rel=0.05)


def test_engine_steps_as_the_server_ran_them_are_fitted_as_shares_of_the_profiles():
    """The server times its lone prefill steps 15 % and its decode steps 8 % over the profile's
    (the machine slower minutes later, or serving's own cost): the simulator runs every engine step
    so, and the lone TTFT and TPOT come back; the per-request and per-step costs are what the
    client saw beyond the server's steps."""
    profile = synthetic_profile()
    probed, engine_lone, engine_batch = _probe_loads(profile)
    one_thread_ms = profile.chunk_s(0, 512, 1) * 1e3
    lone_step_ms = 1.08 * engine_lone.tpot_ms["p50"]
    lone = {
        "p50_ttft_ms": engine_lone.ttft_ms["p50"] + 0.15 * one_thread_ms + 20.0,
        "p50_tpot_ms": lone_step_ms + 2.0,
        "median_server_prefill_ms": 1.15 * one_thread_ms,
        "median_server_decode_step_ms": lone_step_ms,
    }
    batch_step_ms = 1.05 * engine_batch.tpot_ms["p50"]  # another load, another spell
    batch = {
        "p50_ttft_ms": engine_batch.ttft_ms["p50"],
        "p50_tpot_ms": batch_step_ms + 2.0 + 3 * 0.5,
        "median_server_decode_step_ms": batch_step_ms,
    }
    serving = fit(profile, lone, batch, 5, 4, engine_beside_ms=1.1 * one_thread_ms)
    assert (serving.prefill_share, serving.decode_share) == pytest.approx((0.15, 0.08))
    assert serving.request_s == pytest.approx(0.020, abs=1e-3)
    assert serving.step_s == pytest.approx(0.002 - serving.token_s, abs=1e-6)
    assert serving.fitted_from["engine_prefill_ms_beside"] == pytest.approx(1.1 * one_thread_ms)
    again_lone, again_batch = _resimulated(profile, serving, probed)
    assert again_lone.ttft_ms["p50"] == pytest.approx(lone["p50_ttft_ms"], rel=0.01)
    assert again_lone.tpot_ms["p50"] == pytest.approx(lone["p50_tpot_ms"], rel=0.01)
    # the batch's TPOT too, though its steps ran at another speed than the lone one's: the fit
    # charges what the model will (first order: the costs move the second wave's arrivals a little)
    assert again_batch.tpot_ms["p50"] == pytest.approx(batch["p50_tpot_ms"], rel=0.03)


def test_serving_costs_round_trip_and_an_old_profile_reads_without_them(tmp_path):
    profile = synthetic_profile().with_serving(ServingCosts(0.05, 0.004, 0.0002, {"k": 1}))
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    old = json.loads(
        (ROOT / "benchmarks/results/planner/profile-epyc-avx512-bf16.json").read_text()
    )
    assert "serving" not in old and Profile.from_json(old).serving is None


def test_kv_capacity_holds_requests_until_one_ends():
    """Room for two requests' blocks: of four sent at once, the last two start prefilling only when
    the first two have finished; without a limit all four run together."""
    base = synthetic_profile()
    requests = [Request(0.0, 512, 32, i, 0) for i in range(4)]
    shape = SystemShape.parse("colo1@1", lend_cores=False)
    tight = Profile.from_json({**base.to_json(), "kv_capacity_tokens": 2 * (512 + 32)})
    held = simulate(tight, shape, SLO_LOOSE, requests)
    free = simulate(base, shape, SLO_LOOSE, requests)
    assert held.ttft_ms["p99"] > free.ttft_ms["p99"] + 200 and held.requests == 4
    too_small = Profile.from_json({**base.to_json(), "kv_capacity_tokens": 100})
    with pytest.raises(ValueError, match="does not fit a decode worker's KV cache"):
        simulate(too_small, shape, SLO_LOOSE, requests)


def test_kv_capacity_order_is_first_come_first_served():
    from pdserve.planner.simulator import Simulation

    base = synthetic_profile()
    tight = Profile.from_json({**base.to_json(), "kv_capacity_tokens": 512 + 32})
    simulation = Simulation(tight, SystemShape.parse("colo1@1", lend_cores=False), SLO_LOOSE)
    requests = [Request(0.001 * i, 512, 32, i, 0) for i in range(3)]
    simulation.run(requests)
    # one at a time, in arrival order: each starts prefilling once the one before has ended
    for before, stream in zip(simulation.streams, simulation.streams[1:]):
        started_s = stream.arrival_s + stream.queue_s
        assert started_s == pytest.approx(before.token_times_s[-1], abs=1e-6)


def test_conversation_turns_follow_replies_and_reuse_the_history():
    workload = Workload.parse("users=2,turns=3,system=256,turn=64,out=64,think=1,seed=3")
    requests = workload.requests(0.5)
    assert [r.prompt_tokens for r in requests] == [334, 472, 610] * 2  # as the client's chats
    assert [r.follows for r in requests] == [None, 0, 1, None, 3, 4]
    from pdserve.planner.simulator import Simulation

    simulation = Simulation(synthetic_profile(), SystemShape.parse("1p1d@1"), SLO_LOOSE)
    report = simulation.run(requests)
    for later in (1, 2, 4, 5):
        stream, before = simulation.streams[later], simulation.streams[later - 1]
        assert stream.arrival_s == pytest.approx(before.token_times_s[-1] + requests[later].think_s)
    # later turns are short on top of the history the decode worker holds: prefilled there (auto)
    assert report.utilisation["prefill"] < 0.05
    assert report.requests == 6


def test_bench_arrivals_are_the_clients_own():
    from pdserve.bench import arrival_times_s

    workload = Workload.parse("in=512,out=128,n=32,arrival=bench,seed=12")
    assert [r.arrival_s for r in workload.requests(1.0)] == arrival_times_s(32, 1.0, 1.0, 12)


def test_gpu_profile_from_the_stored_h200_check_and_its_plan():
    from pdserve.planner.gpu_profile import from_gpu_check

    speed = json.loads((ROOT / "benchmarks/results/gpu/h200_speed.json").read_text())
    profile = from_gpu_check(speed)
    measured = speed["sections"]["engine_speed"]["pdserve"]
    assert profile.prefill_s(4096) == pytest.approx(measured["ttft_ms"]["4096"] / 1e3)
    assert profile.decode_step_s(1, 576) == pytest.approx(measured["tpot_ms"] / 1e3)
    assert profile.decode_step_s(64, 576) > profile.decode_step_s(1, 576)
    assert profile.decode_step_s(64, 4096) > profile.decode_step_s(64, 576)
    assert 500_000 < profile.kv_capacity_tokens < 1_000_000  # ~110 GB of KV at 128 KiB a token
    slo = SLO.parse("ttft:500,tpot:50")
    requests = Workload.parse("in=2048,out=256,n=600").requests(100.0)

    def attainment(text: str, prefill_order: str = "slo") -> float:
        shape = SystemShape.parse(
            text,
            lend_cores=False,
            transport="pinned",
            max_num_batched_tokens=8192,
            prefill_order=prefill_order,
        )
        return simulate(profile, shape, slo, requests, node_cores=8).slo_attainment

    # 100 req/s x 46 ms of prefill each is 4.6 GPUs of prefill work: four cannot hold it. First come
    # first served, under half the requests meet the SLO; by their deadlines more do (the late ones
    # wait), still short of 0.9
    fcfs = attainment("4p4d@1/remote", "fcfs")
    assert fcfs < 0.5 < attainment("4p4d@1/remote") < 0.9 <= attainment("6p4d@1/remote")


def test_validation_table_from_a_bench_result(tmp_path):
    from pdserve.planner.validation import markdown, rows

    result = {
        "config": {"random_input_len": 128, "random_output_len": 16, "num_prompts": 20, "seed": 4},
        "results": [
            {
                "request_rate": 1.0,
                "p50_ttft_ms": 150.0,
                "p90_ttft_ms": 200.0,
                "p50_tpot_ms": 12.0,
                "request_goodput": 0.9,
            }
        ],
    }
    (tmp_path / "one.json").write_text(json.dumps(result))
    table = rows(synthetic_profile(), tmp_path, {"one": "1p1d@1"}, SLO.parse("ttft:1000,tpot:50"))
    assert len(table) == 1 and table[0]["measured"]["ttft_p90_ms"] == 200.0
    assert table[0]["predicted"]["ttft_p50_ms"] > 0
    text = markdown(table)
    assert "| one (1p1d@1) | random | 1 |" in text and "/ 150 (" in text


def test_best_of_picks_the_shape_with_the_highest_goodput_at_the_rate():
    """Prefill-bound (0.25 s a prompt) at 6 req/s: one prefill worker cannot keep up, two can; the
    decode pool's size does not matter. Of 1P+2D and 2P+1D on the same CPUs, 2P+1D."""
    from pdserve.planner.search import best_of

    profile = synthetic_profile(
        prefill_s_per_token=0.25 / 512, decode_base_s=0.005, decode_per_seq_s=0.0001, threads=(1,)
    )
    shapes = [SystemShape.parse(t, lend_cores=False) for t in ("1p2d@1/remote", "2p1d@1/remote")]
    slo = SLO.parse("ttft:2000,tpot:20")
    plan = best_of(profile, Workload(num_requests=300), slo, 6.0, shapes)
    assert str(plan.shape) == "2p1d@1/remote"
    goodputs = {t["shape"]: t["goodput_rps"] for t in plan.tried}
    assert goodputs["2p1d@1/remote"] > 2 * goodputs["1p2d@1/remote"]


def test_borrowing_cost_is_fitted_on_the_load_with_lending_on():
    """The lone load with lending on runs every step on both cores; what it takes beyond the
    simulator's figure (with the serving path's costs already in) is the cost of a borrowed step."""
    profile = synthetic_profile()
    probed, lone_sim, batch_sim = _probe_loads(profile)
    lone = {"p50_ttft_ms": lone_sim.ttft_ms["p50"], "p50_tpot_ms": lone_sim.tpot_ms["p50"]}
    batch = {"p50_ttft_ms": batch_sim.ttft_ms["p50"], "p50_tpot_ms": batch_sim.tpot_ms["p50"]}
    lent_sim = simulate(profile, SystemShape.parse(PROBE_SHAPE), SLO_LOOSE, closed_loop(5, 1))
    assert lent_sim.ttft_ms["p50"] < 0.6 * lone_sim.ttft_ms["p50"]  # two threads: lending works
    lent = {
        "p50_ttft_ms": lent_sim.ttft_ms["p50"] + 30.0,
        "p50_tpot_ms": lent_sim.tpot_ms["p50"] + 1.0,
    }
    serving = fit(profile, lone, batch, 5, 4, lent)
    assert serving.request_s == pytest.approx(0.0, abs=1e-6)
    assert serving.borrow_prefill_s == 0.0  # a share of the step, which a short prompt pays less of
    assert serving.borrow_prefill_share == pytest.approx(
        0.030 / profile.chunk_s(0, 512, 2), rel=0.03
    )
    assert serving.borrow_decode_s == pytest.approx(0.001, abs=1e-4)
    again = simulate(
        profile.with_serving(serving), SystemShape.parse(PROBE_SHAPE), SLO_LOOSE, closed_loop(5, 1)
    )
    assert again.ttft_ms["p50"] == pytest.approx(lent["p50_ttft_ms"], rel=0.01)
    assert again.tpot_ms["p50"] == pytest.approx(lent["p50_tpot_ms"], rel=0.02)
    # lending off: no borrowed steps, so the costs change nothing there
    assert simulate(profile.with_serving(serving), probed, SLO_LOOSE, closed_loop(5, 1)).ttft_ms[
        "p50"
    ] == pytest.approx(lone["p50_ttft_ms"])


def test_the_servers_own_step_times_keep_a_slower_machine_out_of_the_serving_costs():
    """The probe ran while the machine was 30 % slower than when it was profiled (this VM's speed
    drifts so): the server's timing of its prefill and decode steps says so, the engine's steps are
    charged as the server ran them, and only what the client saw beyond them is the serving path's;
    borrowing's share is read from the server's two prefill times."""
    profile = synthetic_profile()
    probed, lone_sim, batch_sim = _probe_loads(profile)
    one_thread_ms, two_threads_ms = (profile.chunk_s(0, 512, t) * 1e3 for t in (1, 2))
    slower = 1.3
    # a decode step costs 3 ms beyond the engine's, and 0.5 ms per token of its batch
    lone_step_ms = slower * lone_sim.tpot_ms["p50"]
    batch_step_ms = slower * batch_sim.tpot_ms["p50"]
    lone = {
        "p50_ttft_ms": lone_sim.ttft_ms["p50"] + (slower - 1) * one_thread_ms + 40.0,
        "p50_tpot_ms": lone_step_ms + 3.5,
        "median_server_prefill_ms": slower * one_thread_ms,
        "median_server_decode_step_ms": lone_step_ms,
    }
    batch = {
        "p50_ttft_ms": batch_sim.ttft_ms["p50"],
        "p50_tpot_ms": batch_step_ms + 3 + 4 * 0.5,
        "median_server_decode_step_ms": batch_step_ms,
    }
    lent = {
        "p50_ttft_ms": 0.0,  # the fit reads the server's times instead
        "p50_tpot_ms": lone_sim.tpot_ms["p50"],
        "median_server_prefill_ms": slower * two_threads_ms * 1.25,
    }
    serving = fit(profile, lone, batch, 5, 4, lent)
    assert serving.request_s == pytest.approx(0.040, abs=1e-3)
    assert (serving.step_s, serving.token_s) == pytest.approx((0.003, 0.0005), abs=1e-6)
    assert (serving.prefill_share, serving.decode_share) == pytest.approx((0.3, 0.3))
    assert serving.borrow_prefill_share == pytest.approx(0.25, rel=1e-6)
    # without the server's times the slower spell lands in the per-request and per-step costs
    client_only = fit(
        profile,
        {k: v for k, v in lone.items() if "server" not in k},
        {k: v for k, v in batch.items() if "server" not in k},
        5,
        4,
    )
    assert client_only.request_s == pytest.approx(0.040 + 0.3 * one_thread_ms / 1e3, abs=1e-3)
    assert client_only.step_s > 0.003 + 0.2 * lone_sim.tpot_ms["p50"] / 1e3


def test_a_chunk_after_cached_context_is_read_from_its_own_points():
    """Measured prompt-after-context steps replace the estimate from fresh prompts (which leaves out
    attention over the context): bilinear in context and new tokens; without them, the estimate."""
    from pdserve.planner.profile import ContextPrefillPoint

    base = synthetic_profile()
    assert base.chunk_s(256, 384) == pytest.approx(0.128)  # the estimate: 128 tokens at 1 ms
    points = tuple(
        ContextPrefillPoint(c, n, 1, 0.002 * n + 0.0001 * c) for c in (256, 1024) for n in (64, 256)
    )
    measured = Profile.from_json({**base.to_json(), "context_prefill": [vars(p) for p in points]})
    assert measured.chunk_s(256, 384) == pytest.approx(0.002 * 128 + 0.0001 * 256)
    assert measured.chunk_s(640, 800) == pytest.approx(0.002 * 160 + 0.0001 * 640)
    assert measured.chunk_s(0, 512) == base.chunk_s(0, 512)  # nothing cached: a fresh prompt
    assert Profile.from_json(measured.to_json()) == measured
