"""KV reuse across the system (issue #16): the allocators' hash events, reservations that reuse the
decode worker's cached prefix, the router's prefix index and scoring, and real multi-turn
conversations on both transports whose later turns go where their history is cached, ship only the
new blocks and stay token-identical to a cold run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.block_manager import BlockAllocator
from engine.kv_cache import PagedKVCache
from kvtransfer.errors import WireFormatError
from kvtransfer.reservations import Reservations
from kvtransfer.wire import KVGroupHeader, as_bytes_view, checksum, group_payload_bytes
from protocol.block_hash import prompt_block_hashes
from protocol.messages import WorkerCosts, WorkerInfo
from router.kv_index import PrefixIndex, RoutingConfig, rank
from router.pd_policy import Decision, PDPolicyConfig, Side, decide
from router.pools import WorkerHandle
from tests.kv_ends import FP32

# -- the allocator's hash events ------------------------------------------------------------------


def test_the_allocator_logs_the_hashes_it_starts_and_stops_holding():
    allocator = BlockAllocator(4, 4)
    prompt = list(range(1, 10))  # two full blocks and one token
    blocks, cached = allocator.allocate_prompt(prompt)
    assert cached == 0
    assert allocator.track_events() == []  # nothing held yet; events from now on
    allocator.register_computed(prompt, blocks, len(prompt))
    hashes = prompt_block_hashes(prompt, 4)
    assert allocator.drain_events() == [(True, hashes[0]), (True, hashes[1])]
    assert allocator.drain_events() == []
    allocator.free(blocks)  # freed blocks stay cached: no event
    assert allocator.drain_events() == []
    again, cached = allocator.allocate_prompt(prompt + [7])
    assert cached == 8 and again[:2] == blocks[:2]  # the prefix is revived, not recomputed
    allocator.free(again)
    allocator.allocate(4)  # every block handed out again: the cached ones lose their hashes
    assert sorted(allocator.drain_events()) == sorted([(False, hashes[0]), (False, hashes[1])])
    assert allocator.track_events() == []


def test_decoded_blocks_become_cached_when_a_sequence_finishes(smollm_fp32):
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(dtype="float32", num_threads=1, block_size_tokens=4, kv_cache_bytes=16 << 20),
        loaded=smollm_fp32,
    )
    prompt = list(range(100, 110))
    done = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ]
    history = prompt + done.token_ids  # 22 tokens, 21 of them computed: five full blocks
    _, cached = engine.allocator.allocate_prompt(history + [5, 6])
    assert cached == 20  # the answer's blocks too, not only the prompt's (8 tokens)


# -- reservations that reuse a cached prefix ------------------------------------------------------


def _group(cache: PagedKVCache, source_blocks: list[int], request_id: str):
    """One layer group of every layer, as a transport hands it to `install`: (header, payload
    bytes)."""
    data = as_bytes_view(cache.export_blocks(source_blocks))
    layout = cache.layout
    header = KVGroupHeader(
        request_id,
        "s",
        1,
        layout,
        0,
        layout.num_layers,
        len(source_blocks),
        group_payload_bytes(layout, layout.num_layers, len(source_blocks)),
        checksum(data),
    )
    return header, data


def test_a_reservation_reuses_the_cached_prefix_and_receives_only_the_rest():
    cache = PagedKVCache(FP32, 16)
    allocator = BlockAllocator(16, FP32.block_size_tokens)
    history = list(range(1, 14))  # 13 tokens: 3 full blocks of 4
    held, _ = allocator.allocate_prompt(history)
    allocator.register_computed(history, held, len(history))
    allocator.free(held)  # the earlier turn ended; its blocks stay cached
    free_before = allocator.num_free_blocks
    reservations = Reservations(cache, allocator)
    prompt = history + [20, 21, 22, 23, 24]  # 18 tokens: 5 blocks, 3 of them cached
    block_ids, reused = reservations.reserve_prompt("r", prompt, timeout_s=5.0)
    assert reused == 3 and block_ids[:3] == held[:3]
    sender = PagedKVCache(FP32, 4)
    sender.kv.normal_()
    wrong, wrong_data = _group(sender, [0, 1, 2, 3], "r")  # the whole prompt: more than expected
    with pytest.raises(WireFormatError, match="2 expected"):
        reservations.install(wrong, wrong_data)
    header, data = _group(sender, [0, 1], "r")
    before = cache.export_blocks(block_ids[:3]).clone()
    assert reservations.install(header, data)
    assert torch.equal(cache.export_blocks(block_ids[3:]), sender.export_blocks([0, 1]))
    # the reused blocks are untouched
    assert torch.equal(cache.export_blocks(block_ids[:3]), before)
    assert reservations.poll().ready == {"r": block_ids}
    allocator.free(block_ids)
    assert allocator.num_free_blocks == free_before


def test_reused_blocks_are_never_evicted_while_reserved_and_come_back_on_abort():
    cache = PagedKVCache(FP32, 6)
    allocator = BlockAllocator(6, FP32.block_size_tokens)
    history = list(range(1, 10))
    held, _ = allocator.allocate_prompt(history)
    allocator.register_computed(history, held, len(history))
    allocator.free(held)
    reservations = Reservations(cache, allocator)
    block_ids, reused = reservations.reserve_prompt("r", history + [1, 2, 3], timeout_s=5.0)
    assert reused == 2
    # everything else is taken: nothing evicts the reused
    others = allocator.allocate(allocator.num_free_blocks)
    assert not set(others) & set(block_ids)
    assert reservations.abort("r")
    allocator.free(others)
    assert allocator.num_free_blocks == 6
    _, cached = allocator.allocate_prompt(history + [1])
    assert cached == 8  # still cached after the abort


# -- the router's index and scoring ---------------------------------------------------------------


def _worker(worker_id: str, role: str, queued: int = 0, in_flight: int = 0) -> WorkerHandle:
    info = WorkerInfo(worker_id, role, "node", None, 100, 4096, 100, block_size_tokens=4)
    return WorkerHandle(None, info, in_flight=in_flight, queued_prompt_tokens=queued)


def test_the_prefix_index_follows_each_workers_events():
    index = PrefixIndex()
    chain = prompt_block_hashes(list(range(1, 30)), 4)  # 7 blocks
    index.reset("a", chain[:5])
    index.apply("b", [(True, h) for h in chain[:2]] + [(True, chain[3])])  # a hole at block 2
    assert index.cached_blocks(chain, ["a", "b", "c"]) == {"a": 5, "b": 2, "c": 0}
    index.apply("a", [(False, chain[1]), (True, b"other")])
    assert index.cached_blocks(chain, ["a", "b"]) == {"a": 1, "b": 2}
    index.forget("b")
    assert index.cached_blocks(chain, ["a", "b"]) == {"a": 1, "b": 0} and index.num_hashes("b") == 0
    index.reset("a", [])
    assert index.num_hashes("a") == 0


def test_routing_weighs_a_cached_prefix_against_load():
    index = PrefixIndex()
    prompt = list(range(1, 402))  # 100 full blocks of 4 before the last token
    chain = prompt_block_hashes(prompt, 4)
    index.reset("warm", chain[:50])  # holds 200 tokens of it
    warm, cold = _worker("warm", "prefill", queued=150), _worker("cold", "prefill")
    prefix = RoutingConfig()
    assert [c.worker for c in rank(prefix, index, [cold, warm], chain, len(prompt), "prefill")] == [
        warm,
        cold,
    ]
    assert rank(prefix, index, [cold, warm], chain, len(prompt), "prefill")[0].cached_tokens == 200
    warm.queued_prompt_tokens = 250  # now it would start later than recomputing elsewhere
    assert rank(prefix, index, [cold, warm], chain, len(prompt), "prefill")[0].worker is cold
    load = RoutingConfig("load")
    warm.queued_prompt_tokens = 1
    assert rank(load, index, [warm, cold], [], len(prompt), "prefill")[0].worker is cold
    # The decode pool counts running requests as load: a cached history of 200 tokens is worth less
    # than four more running requests at decode_stream_tokens=64.
    busy, idle = _worker("warm", "decode", in_flight=4), _worker("idle", "decode")
    assert rank(prefix, index, [busy, idle], chain, len(prompt), "decode")[0].worker is idle
    index.reset("warm", chain)
    assert rank(prefix, index, [busy, idle], chain, len(prompt), "decode")[0].worker is busy
    with pytest.raises(ValueError, match="--routing"):
        RoutingConfig("random")


def test_a_prompt_whose_prefix_the_decode_worker_holds_prefills_there():
    auto = PDPolicyConfig(local_max_prompt_tokens=64)
    hit = Decision("local", "prefix_hit")
    assert decide(auto, 600, Side(0, 0), Side(0, 560)) == hit
    # Not short enough, but less than half as much to compute there as on the prefill pool (which
    # holds none of it)
    assert decide(auto, 600, Side(0, 0), Side(0, 500)) == hit
    assert decide(auto, 600, Side(0, 560), Side(0, 500)) == Decision("remote", "default")
    # ... while the streams decoding there can wait for it (0.1 s at 1 ms a token)
    prefill = WorkerCosts(prefill_token_s=1e-3)
    busy = WorkerCosts(1e-3, decode_step_s=0.03, decode_slack_s=0.05, interleave_tokens=256)
    assert decide(auto, 600, Side(0, 0, prefill), Side(0, 500, busy)) == Decision(
        "remote", "default"
    )
    roomy = WorkerCosts(1e-3, decode_step_s=0.03, decode_slack_s=0.5, interleave_tokens=256)
    assert decide(auto, 600, Side(0, 0, prefill), Side(0, 500, roomy)) == hit
    assert decide(auto, 40, Side(0, 0), Side(0, 0)) == Decision("local", "short_prompt")


# -- real multi-turn conversations ----------------------------------------------------------------

_SYSTEM = (
    "You are a patient tutor. Answer in plain words and keep each answer short. The student is "
    "studying the history of rivers, trade routes and the towns that grew along them. "
) * 3


@pytest.fixture(scope="module", params=["ray", "grpc"])
def system(request, harness):
    running = harness.start(num_prefill=1, num_decode=2, transport=request.param)
    yield running
    running.stop()


def _counter(system, name: str) -> dict[tuple, float]:
    """A counter of the router's /metrics text (`pdserve_<name>_total`), by its label values."""
    from prometheus_client.parser import text_string_to_metric_families

    text = system.system.router.render_metrics().decode()
    return {
        tuple(sample.labels.values()): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == f"pdserve_{name}"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def _cold(smollm_fp32, prompt_ids: list[int], max_tokens: int) -> list[int]:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=1), loaded=smollm_fp32)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(engine.generate([prompt_ids], params)[0].token_ids)


def _turn(system, prompt_ids: list[int], max_tokens: int = 10, **router_config):
    """One greedy request; with `router_config`, under those RouterConfig fields (the system's own
    after)."""
    router = system.system.router
    own = router.config
    router.config = dataclasses.replace(own, **router_config)
    try:
        with system.client() as client:
            return client.generate(
                client.request(
                    token_ids=prompt_ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
                )
            )
    finally:
        router.config = own


def _first_turn(system, tokenizer, question: str):
    """A conversation's first turn: (its prompt ids, its completion, one KV block's bytes)."""
    prompt = tokenizer.encode(_SYSTEM + question)
    return (
        prompt,
        _turn(system, prompt),
        system.system.router.decode_pool.workers[0].info.kv_block_bytes,
    )


def test_later_turns_go_where_the_history_is_cached_and_ship_only_new_blocks(system, smollm_fp32):
    tokenizer = smollm_fp32.tokenizer
    prompt, first, block_bytes = _first_turn(
        system, tokenizer, "Question: why did towns grow at river crossings?"
    )
    assert first.prefill_worker and first.timings.kv_bytes == -(-len(prompt) // 16) * block_bytes
    reused_before = _counter(system, "kv_reused_bytes").get((), 0)
    for question in (" And why near river mouths?", " What did traders carry on the rivers?"):
        new = first.token_ids + tokenizer.encode(question)
        history = prompt + first.token_ids
        prompt = prompt + new
        turn = _turn(system, prompt)
        # prefix routing: the decode worker holding the history
        assert turn.decode_worker == first.decode_worker
        assert turn.prefill_worker  # pd_policy "remote": still prefilled on the prefill pool...
        new_blocks = -(-(len(new)) // 16)
        # ...which ships only the new blocks
        assert turn.timings.kv_bytes <= (new_blocks + 1) * block_bytes
        assert (
            turn.usage.cached_prompt_tokens >= (len(history) - len(first.token_ids)) // 16 * 16 - 16
        )
        assert list(turn.token_ids) == _cold(smollm_fp32, prompt, 10)
        first = turn
    assert _counter(system, "kv_reused_bytes").get((), 0) > reused_before
    assert _counter(system, "routing_decision").get(("decode", "prefix_hit"), 0) >= 2
    assert _counter(system, "prefix_cache_hit_tokens").get(("prefill",), 0) > 0
    assert system.wait_idle().requests_in_flight == 0


def test_a_later_turn_prefills_on_the_decode_worker_holding_its_history(system, smollm_fp32):
    tokenizer = smollm_fp32.tokenizer
    prompt, first, _ = _first_turn(system, tokenizer, "Question: what is a ford?")
    prompt = prompt + first.token_ids + tokenizer.encode(" Thanks. And a ferry?")
    turn = _turn(system, prompt, pd=PDPolicyConfig("auto", local_max_prompt_tokens=64))
    # computed where it decodes, nothing shipped
    assert not turn.prefill_worker and turn.timings.kv_bytes == 0
    assert turn.decode_worker == first.decode_worker
    assert turn.usage.cached_prompt_tokens >= len(prompt) - 64
    assert _counter(system, "pd_decision").get(("local", "prefix_hit"), 0) >= 1
    assert list(turn.token_ids) == _cold(smollm_fp32, prompt, 10)


def test_load_routing_ships_the_whole_prompt(system, smollm_fp32):
    tokenizer = smollm_fp32.tokenizer
    prompt, first, block_bytes = _first_turn(
        system, tokenizer, "Question: who built the first bridges?"
    )
    prompt = prompt + first.token_ids + tokenizer.encode(" And the first canals?")
    turn = _turn(system, prompt, routing=RoutingConfig("load"))
    assert turn.timings.kv_bytes == -(-len(prompt) // 16) * block_bytes
    assert list(turn.token_ids) == _cold(smollm_fp32, prompt, 10)
    assert system.wait_idle().requests_in_flight == 0
