"""Conditional disaggregation: the policy as a pure function of measured costs, the interleaving
scheduler (and on a CPU its first-come-first-served prefill of long prompts), and a real system
that prefills on its decode worker when the prefill pool's queue would miss the TTFT target, with
output identical to the single-process engine either way."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.block_manager import BlockAllocator
from engine.deadlines import Queued, deadline_order
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from protocol.messages import WorkerCosts, WorkerInfo
from router.counting import QueuedPrompt
from router.kv_index import PrefixIndex, RoutingConfig
from router.metrics import RouterMetrics
from router.pd_policy import Decision, PDPolicyConfig, Side, decide
from router.placement import Placement
from router.pools.workers import WorkerHandle, WorkerPool

MS = 1e-3
REMOTE, LOCAL = Decision("remote", "default"), Decision("local", "prefill_queue")


def test_the_policy_goes_local_when_the_prefill_queue_would_miss_the_ttft_target():
    auto = PDPolicyConfig(local_max_prompt_tokens=64)
    prefill = WorkerCosts(prefill_token_s=1 * MS)
    idle = WorkerCosts(prefill_token_s=1 * MS)  # nothing decodes there: its slack is unbounded
    target_s = 1.0
    assert decide(auto, 32, Side(0, 0, prefill), Side(0, 0, idle), target_s) == Decision(
        "local", "short_prompt"
    )
    # The prefill pool meets the target (0.512 s; 0.912 s behind 400 queued tokens): the streams
    # are never stalled for a prompt
    assert decide(auto, 512, Side(0, 0, prefill), Side(0, 0, idle), target_s) == REMOTE
    assert decide(auto, 512, Side(400, 0, prefill), Side(0, 0, idle), target_s) == REMOTE
    # It would not (1.024 s), and the decode worker answers sooner (0.512 s)
    assert decide(auto, 512, Side(512, 0, prefill), Side(0, 0, idle), target_s) == LOCAL
    # ... unless its own local queue makes it later still
    assert decide(auto, 512, Side(1500, 0, prefill), Side(2000, 0, idle), target_s) == REMOTE
    # Streams decode there: they must be able to wait for the prompt (0.512 s of slack or more),
    # and its first token comes after a decode step per interleaved chunk (2 x 30 ms here)
    tight = WorkerCosts(1 * MS, decode_step_s=0.030, decode_slack_s=0.3, interleave_tokens=256)
    roomy = WorkerCosts(1 * MS, decode_step_s=0.030, decode_slack_s=0.6, interleave_tokens=256)
    assert decide(auto, 512, Side(2048, 0, prefill), Side(0, 0, tight), target_s) == REMOTE
    assert decide(auto, 512, Side(2048, 0, prefill), Side(0, 0, roomy), target_s) == LOCAL
    # both miss a 0.5 s target, and the decode worker would be later (0.572 s against 0.562 s)
    assert decide(auto, 512, Side(50, 0, prefill), Side(0, 0, roomy), 0.5) == REMOTE
    # Measured rates count, not tokens: a prefill worker twice as fast meets the target
    fast = WorkerCosts(prefill_token_s=0.5 * MS)
    assert decide(auto, 512, Side(1024, 0, fast), Side(0, 0, idle), target_s) == REMOTE
    # Nothing measured yet: the prefill pool
    assert decide(auto, 512, Side(10**6, 0), Side(0, 0), target_s) == REMOTE
    assert decide(auto, 512, None, Side(0, 0), target_s) == Decision("local", "no_prefill_worker")
    policy = PDPolicyConfig("remote")
    assert decide(policy, 8, Side(10**6, 0), Side(0, 0)) == Decision("remote", "policy")
    policy = PDPolicyConfig("local")
    assert decide(policy, 8000, Side(0, 0), Side(10**6, 0)) == Decision("local", "policy")
    with pytest.raises(ValueError, match="--pd-policy"):
        PDPolicyConfig("sometimes")


def _seq(request_id: str, prompt_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=100))


def test_a_new_prompt_reckons_its_remote_ttft_from_its_place_in_the_deadline_order():
    """A prompt sent to a prefill worker whose queue holds late prompts goes ahead of them there
    (engine.deadlines), so the PD policy reckons its remote TTFT from the prompts before it, not
    the whole queue: it stays on the prefill pool, where it meets the target, and no stream on the
    decode worker waits for it."""
    prefill = _worker("prefill-0", "prefill", WorkerCosts(prefill_token_s=1 * MS))
    decode = _worker("decode-0", "decode", WorkerCosts(prefill_token_s=1 * MS))
    placement = Placement(
        RoutingConfig("load"),
        PDPolicyConfig(),
        PrefixIndex(),
        WorkerPool("prefill", [prefill]),
        WorkerPool("decode", [decode]),
        RouterMetrics(),
        1.0,
    )
    prompt = placement.prompt(list(range(1, 513)))  # 0.512 s on either worker
    now = time.monotonic()
    # the prompt sent first is the one the worker computes now: the new one waits for it
    running = QueuedPrompt(prefill, 128, now + 0.9)
    # 1024 tokens already late (due in 0.3 s): the new prompt goes ahead of them, its first token
    # in 0.64 s; counting the whole queue it would take 1.664 s and go to the decode worker
    late = QueuedPrompt(prefill, 1024, now + 0.3)
    assert placement.place(prompt) == REMOTE
    # 256 tokens that can make their deadline go before it: 0.896 s
    soon = QueuedPrompt(prefill, 256, now + 0.9)
    assert placement.place(prompt) == REMOTE
    # 512 more of them: it would be late itself (1.408 s), behind the late ones (2.432 s)
    later = QueuedPrompt(prefill, 512, now + 0.95)
    assert prefill.queued_prompt_tokens == 1920
    assert placement.place(prompt) == LOCAL
    later.release()
    soon.release()
    # a prompt sent without a deadline (first come first served, a migration's re-prefill) goes
    # by its arrival: the new one waits for it, and for the late ones too once it is late itself
    undated = QueuedPrompt(prefill, 1024, None)
    assert placement.place(prompt) == LOCAL
    for count in (undated, late, running):
        count.release()
    assert prefill.queued_prompt_tokens == 0 and not prefill.queued_prompts


def _worker(worker_id: str, role: str, costs: WorkerCosts) -> WorkerHandle:
    info = WorkerInfo(worker_id, role, "node", None, 100, 4096, 100, block_size_tokens=16)
    return WorkerHandle(None, info, costs=costs)


def test_the_scheduler_interleaves_prefill_chunks_with_decode_steps():
    allocator = BlockAllocator(64, 16, enable_prefix_caching=False)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, decode_interleave_tokens=100), allocator
    )
    decoding = _seq("decoding", 10)
    scheduler.add(decoding)
    first = scheduler.schedule()
    # nothing decodes yet: the whole budget
    assert first.is_prefill and first.num_new_tokens == [10]
    scheduler.after_prefill(first)
    decoding.output_token_ids.append(5)
    scheduler.add_running(decoding)
    scheduler.add(_seq("long", 250))
    kinds = []
    for _ in range(7):
        batch = scheduler.schedule()
        kinds.append(
            ("prefill", batch.num_new_tokens[0])
            if batch.is_prefill
            else ("decode", len(batch.seqs))
        )
        if batch.is_prefill:
            for seq in scheduler.after_prefill(batch):
                seq.output_token_ids.append(5)
                scheduler.add_running(seq)
        else:
            scheduler.after_decode(batch)
            for seq in batch.seqs:
                seq.output_token_ids.append(5)
    assert kinds == [
        ("decode", 1),
        ("prefill", 100),
        ("decode", 1),
        ("prefill", 100),
        ("decode", 1),
        ("prefill", 50),
        ("decode", 2),
    ]  # after a prefill step a decode step, always


def test_on_a_cpu_long_prompts_prefill_one_at_a_time_and_short_ones_share_a_step():
    allocator = BlockAllocator(256, 16, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_batched_tokens=2048, prefill_batch_tokens=256)
    scheduler = Scheduler(config, allocator)
    for request_id, tokens in (("a", 100), ("b", 100), ("c", 512), ("d", 40), ("e", 30)):
        scheduler.add(_seq(request_id, tokens))
    steps = []
    while scheduler.waiting:
        batch = scheduler.schedule()
        steps.append(
            [(seq.request_id, chunk) for seq, chunk in zip(batch.seqs, batch.num_new_tokens)]
        )
        scheduler.after_prefill(batch)
    # first come, first served: "c" waits for the step before it, and nothing joins it
    assert steps == [[("a", 100), ("b", 100)], [("c", 512)], [("d", 40), ("e", 30)]]
    # a GPU's engine (no limit) batches every waiting prompt the budget holds
    from engine.config import EngineConfig

    assert EngineConfig(cpu_prefill_batch_tokens=256).scheduler("cuda").prefill_batch_tokens is None
    assert EngineConfig(cpu_prefill_batch_tokens=256).scheduler("cpu").prefill_batch_tokens == 256
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        SchedulerConfig(prefill_batch_tokens=0)


def test_prompts_with_ttft_deadlines_go_earliest_first_and_the_late_ones_last():
    allocator = BlockAllocator(256, 16, enable_prefix_caching=False)
    clock = [10.0]
    config = SchedulerConfig(max_num_batched_tokens=2048, prefill_batch_tokens=256)
    scheduler = Scheduler(config, allocator, clock=lambda: clock[0])
    scheduler.prefill_token_s = 0.001  # a 500-token prompt: 0.5 s
    # a is late already; c would end at 11.0, after b, past its 10.8; d ends at 11.0, in time
    for request_id, deadline_s in (("a", 9.0), ("c", 10.8), ("b", 10.6), ("d", 11.6)):
        seq = _seq(request_id, 500)
        seq.arrival_time_s, seq.ttft_deadline_s = deadline_s - 4.0, deadline_s
        scheduler.add(seq)
    assert [seq.request_id for seq in scheduler.prefill_order()] == ["b", "d", "a", "c"]
    steps = []
    while scheduler.waiting:
        batch = scheduler.schedule()
        steps.append([seq.request_id for seq in batch.seqs])
        scheduler.after_prefill(batch)
        clock[0] += 0.5
    assert steps == [["b"], ["d"], ["a"], ["c"]]


def test_the_deadline_order_keeps_begun_prompts_in_front_and_bounds_how_long_late_ones_wait():
    order = deadline_order(
        [
            Queued("late", 100, 1.8, 0.0, False),
            Queued("no_deadline", 100, None, 1.5, False),
            Queued("begun", 100, 0.5, 0.0, True),
            Queued("in_time", 100, 9.0, 5.0, False),
        ],
        now_s=2.0,
        token_s=0.01,  # 1 s a prompt
    )
    assert order == ["begun", "no_deadline", "in_time", "late"]
    # a late prompt is passed over until half its TTFT budget past its deadline (1 s: from 2.0 on)
    overdue = [Queued("in_time", 100, 9.0, 5.0, False), Queued("late", 100, 1.5, 0.5, False)]
    assert deadline_order(overdue, now_s=1.9, token_s=0.01) == ["in_time", "late"]
    assert deadline_order(overdue, now_s=2.1, token_s=0.01) == ["late", "in_time"]
    # without deadlines (fcfs, the engine alone): as given
    fcfs = [Queued(name, 100, None, 0.0, False) for name in "xyz"]
    assert deadline_order(fcfs, now_s=0.0, token_s=1.0) == ["x", "y", "z"]


@pytest.fixture(scope="module")
def system(harness, tmp_path_factory):
    # Its own directory for lending cores: only its two workers register there, so an earlier
    # module's workers that are still exiting cannot make a home core look shared (such a worker
    # never borrows)
    running = harness.start(
        num_prefill=1,
        num_decode=1,
        pd_policy="auto",
        local_prefill_max_tokens=16,
        # a TTFT target no queue meets: a prompt goes local whenever its first token comes sooner
        # there (the TPOT target lends cores as freely as serving's default)
        slo="ttft:1,tpot:50",
        kv_cache_bytes=128 << 20,
        http_port=0,
        core_dir=str(tmp_path_factory.mktemp("cores")),
    )
    yield running
    running.stop()


def _decisions(system) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = system.system.router.render_metrics().decode()
    return {
        tuple(sample.labels[k] for k in ("path", "reason")): sample.value
        for metric in text_string_to_metric_families(text)
        if metric.name == "pdserve_pd_decision"
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def test_a_prefill_queue_that_misses_the_ttft_target_sends_prompts_to_the_decode_worker(
    system, smollm_fp32
):
    from engine.llm_engine import EngineConfig, LLMEngine

    prompts = [
        f"Request {i}. " + "Rivers shaped where people settled, traded and fought. " * 25
        for i in range(4)
    ]
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1), loaded=smollm_fp32)
    expected = [
        list(r.token_ids)
        for r in engine.generate(
            prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
    ]
    # The prefill worker's cost per token is measured on a first prompt; then the decode worker,
    # idle, answers a prompt sooner than the prefill worker with one queued.
    with system.client() as client:
        warm = client.generate(
            client.request(prompts[0], max_tokens=12, temperature=0, ignore_eos=True)
        )
    assert warm.prefill_worker and list(warm.token_ids) == expected[0]
    before = _decisions(system)
    with ThreadPoolExecutor(len(prompts)) as pool:

        def one(prompt):
            with system.client() as client:
                return client.generate(
                    client.request(prompt, max_tokens=12, temperature=0, ignore_eos=True)
                )

        done = list(pool.map(one, prompts))
    after = _decisions(system)
    local = after.get(("local", "prefill_queue"), 0) - before.get(("local", "prefill_queue"), 0)
    remote = after.get(("remote", "default"), 0) - before.get(("remote", "default"), 0)
    # the first goes remote, a later one finds its queue long
    assert local >= 1 and remote >= 1, after
    assert [list(d.token_ids) for d in done] == expected
    local_done = [d for d in done if not d.prefill_worker]
    assert local_done and all(d.timings.kv_bytes == 0 for d in local_done)
    # A short prompt prefills where it decodes; the metric names the reason.
    with system.client() as client:
        short = client.generate(
            client.request("Hi there", max_tokens=4, temperature=0, ignore_eos=True)
        )
    assert not short.prefill_worker and _decisions(system)[("local", "short_prompt")] >= 1
    assert system.wait_idle().requests_in_flight == 0


def _borrowed_core_steps(system) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(
        f"http://127.0.0.1:{system.system.http_port}/metrics", timeout=30
    ) as reply:
        families = text_string_to_metric_families(reply.read().decode())
        return {
            sample.labels["worker"]: sample.value
            for family in families
            if family.name == "pdserve_worker_borrowed_core_steps"
            for sample in family.samples
        }


def test_a_worker_prefilling_while_the_other_idles_borrows_its_core_with_identical_output(
    system, smollm_fp32
):
    from engine.llm_engine import EngineConfig, LLMEngine

    # One core each (0.5 CPU granted), on a node of two cores: each worker's prefill steps may run
    # on both.
    long_prompt = "Rivers shaped where people settled, traded and fought. " * 6
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1), loaded=smollm_fp32)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [list(r.token_ids) for r in engine.generate(["Hi there", long_prompt], params)]
    assert system.wait_idle().requests_in_flight == 0
    homes = _homes(system.config.core_policy.path)
    assert len(homes) == 2 and len({core for cores in homes for core in cores}) == 2, homes
    before = _borrowed_core_steps(system)
    with system.client() as client:
        short = client.generate(
            client.request("Hi there", max_tokens=6, temperature=0, ignore_eos=True)
        )
        remote = client.generate(
            client.request(long_prompt, max_tokens=6, temperature=0, ignore_eos=True)
        )
    after = _borrowed_core_steps(system)
    assert not short.prefill_worker and remote.prefill_worker == "prefill-0"
    assert [list(short.token_ids), list(remote.token_ids)] == expected
    assert after["decode-0"] > before.get("decode-0", 0), after
    assert after["prefill-0"] > before.get("prefill-0", 0), after


def _homes(directory) -> list[list[int]]:
    """The home cores of the live workers registered in `directory`."""
    import json

    from runtime.cores import _live

    return list(_live(json.loads((directory / "homes.json").read_text())).values())


def test_a_slow_link_sends_the_prompt_to_prefill_on_its_decode_worker():
    """The remote path's time counts the KV handoff over the link between the two nodes: where the
    prefill pool meets the TTFT target but shipping the KV would not, the decode worker prefills
    (reason "link"), if its streams can wait; an unknown link costs nothing."""
    auto = PDPolicyConfig(local_max_prompt_tokens=64)
    prefill, idle = WorkerCosts(prefill_token_s=1 * MS), WorkerCosts(prefill_token_s=1 * MS)
    # 0.512 s of prefill, then 0.2 s over the link: within 1 s, remote
    assert decide(auto, 512, Side(0, 0, prefill, 0.2), Side(0, 0, idle), 1.0) == REMOTE
    # 1.2 s over a slow link: the decode worker, 0.512 s, sooner and in time
    slow = Side(0, 0, prefill, 1.2)
    assert decide(auto, 512, slow, Side(0, 0, idle), 1.0) == Decision("local", "link")
    # streams that cannot wait for the prompt keep it remote
    tight = WorkerCosts(1 * MS, decode_step_s=0.030, decode_slack_s=0.3, interleave_tokens=256)
    assert decide(auto, 512, slow, Side(0, 0, tight), 1.0) == REMOTE
    assert decide(auto, 512, Side(0, 0, prefill), Side(0, 0, idle), 1.0) == REMOTE


def test_links_learn_latency_and_bandwidth_from_handoffs():
    from router.links import Links

    links = Links()
    assert links.transfer_s("a", "b", 10**6) == 0.0  # unknown: free until it shows otherwise
    # 2 ms + bytes at 100 MB/s, handoffs of several sizes
    for size in (1 << 20, 4 << 20, 12 << 20, 2 << 20):
        links.observe("a", "b", size, 0.002 + size / 100e6)
    estimate = links.estimate("a", "b")
    assert estimate.handoffs == 4
    assert estimate.latency_s == pytest.approx(0.002, rel=1e-6)
    assert estimate.bandwidth_bytes_per_s == pytest.approx(100e6, rel=1e-6)
    assert links.transfer_s("a", "b", 50_000_000) == pytest.approx(0.502, rel=1e-6)
    assert links.estimate("b", "a") is None  # each direction is its own link
    # sizes alike: the bandwidth from the sums
    links.observe("c", "d", 1 << 20, 0.01)
    assert links.estimate("c", "d").bandwidth_bytes_per_s == pytest.approx((1 << 20) / 0.01)
    links.observe("c", "d", 0, 1.0)  # nothing shipped (every block reused): says nothing
    assert links.estimate("c", "d").handoffs == 1
