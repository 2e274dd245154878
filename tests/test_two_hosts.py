"""pdserve across two hosts: a Ray cluster over a real, shaped link (tests/two_hosts.py: two network
namespaces on this machine, 1 Gbit/s between them), the router and the prefill pool on host A, the
decode pool on host B, so every KV byte, token and acknowledgement crosses the link. Greedy fp32
output through each transport is token-identical to the single-process engine, a later turn ships
only its new blocks, a partition in the middle of the streams stalls them and no more, and no worker
holds a block afterwards.

Needs root (network namespaces), as CI has: without it the module fails, it does not skip.
Everything Ray runs in the two namespaces (`pdserve serve` included), so the session's own Ray
cluster is left alone. Costs about a minute per transport on this repo's 2-core machines (two
workers loading the model), plus ~20 s for the cluster.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.two_hosts import TwoHosts, assert_no_block_held

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three rivers in Europe.",
]
MAX_TOKENS = 24
# the partition's streams: long enough to be decoding on B when the link goes down on any CPU
MAX_TOKENS_LONG = 64
FOLLOW_UP = "And what is the capital of Italy?"
# fp32 KV of the default model: 30 layers x K and V x 3 heads x 64 x 4 bytes
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


@pytest.fixture(scope="module")
def hosts():
    hosts = TwoHosts.create(rate="1gbit")  # fails the module (no skip) where it cannot
    try:
        hosts.start_ray(head_cpus=2, node_cpus=1)
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def engine(smollm_fp32):
    return LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)


def _greedy(engine, messages_list, max_tokens=MAX_TOKENS):
    prompts = [engine.tokenizer.encode_chat(messages) for messages in messages_list]
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))


@pytest.fixture(scope="module")
def expected(engine):
    results = _greedy(engine, [[{"role": "user", "content": q}] for q in QUESTIONS])
    return {q: r for q, r in zip(QUESTIONS, results)}


class Servers:
    """One `pdserve serve` at a time on the hosts (two cores: the workers of two would fight)."""

    def __init__(self, hosts: TwoHosts):
        self.hosts = hosts
        self.transport = None
        self.server = None

    def get(self, transport: str):
        if self.transport != transport:
            self.stop()
            self.server = self.hosts.serve(
                f"--transport={transport}",
                "--dtype=float32",
                "--kv-cache-mib=64",
                "--pd-policy=remote",  # every request's KV crosses the link
                "--lend-cores=off",  # the two hosts' workers share this machine's cores
                "--prefill=1",
                "--decode=1",
            )
            self.transport = transport
        return self.server

    def stop(self):
        if self.server is not None:
            self.server.stop()
        self.server = self.transport = None


@pytest.fixture(scope="module")
def servers(hosts):
    servers = Servers(hosts)
    yield servers
    servers.stop()


def _chat_all(server, questions):
    def one(question):
        with server.client() as client:
            return client.chat(question, max_tokens=MAX_TOKENS, temperature=0)

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(one, questions))


def _node_addresses(hosts) -> dict[str, str]:
    """Ray node id -> the address it was started with."""
    from ray._raylet import GcsClient

    nodes = GcsClient(address=hosts.cluster.address).get_all_node_info(timeout=10)
    return {node_id.hex(): info.node_manager_address for node_id, info in nodes.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["ray", "rdt", "grpc"])
def test_greedy_output_across_the_link_equals_the_engine(hosts, servers, expected, transport):
    server = servers.get(transport)
    completions = _chat_all(server, QUESTIONS)
    for question, completion in zip(QUESTIONS, completions):
        assert completion.token_ids == expected[question].token_ids, question
        assert completion.finish_reason == expected[question].finish_reason
        assert completion.prefill_worker == "prefill-0" and completion.decode_worker == "decode-0"
        assert completion.timings.kv_bytes > 0
    stats = server.wait_idle()
    assert_no_block_held(stats)
    # the pools on their hosts: the prefill worker on A, the decode worker on B
    addresses = _node_addresses(hosts)
    where = {
        w.worker_id: next(ip for node, ip in addresses.items() if node.startswith(w.node))
        for w in stats.workers
    }
    assert where == {"prefill-0": hosts.a, "decode-0": hosts.b}
    handoffs = ", ".join(
        f"{c.timings.kv_bytes / 1e6:.2f} MB in {c.timings.kv_transfer_s * 1e3:.0f} ms"
        for c in completions
    )
    print(f"{transport}: KV handoffs over {hosts.link.current.rate}: {handoffs}")


@pytest.mark.timeout(300)
def test_a_later_turn_sends_only_its_new_blocks_across_the_link(servers, engine, expected):
    server = servers.get("grpc")
    first = [{"role": "user", "content": QUESTIONS[0]}]
    with server.client() as client:
        turn_1 = client.chat(QUESTIONS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert turn_1.token_ids == expected[QUESTIONS[0]].token_ids
        messages = [
            *first,
            {"role": "assistant", "content": turn_1.text},
            {"role": "user", "content": FOLLOW_UP},
        ]
        turn_2 = client.generate(
            client.request(messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        )
    (reference,) = _greedy(engine, [messages])
    assert turn_2.token_ids == reference.token_ids
    # the decode worker on B holds the first turn's blocks: only the rest crossed
    whole_prompt_bytes = turn_2.usage.prompt_tokens * KV_BYTES_PER_TOKEN
    assert 0 < turn_2.timings.kv_bytes < whole_prompt_bytes, (turn_2.timings, turn_2.usage)
    assert_no_block_held(server.wait_idle())


@pytest.mark.timeout(300)
def test_a_partition_in_the_middle_of_the_streams_stalls_them_and_they_finish_identical(
    hosts, servers, engine
):
    """The link drops every packet for 6 s (well inside Ray's ~40 s node timeout) while three
    streams decode on B: none finishes before the link heals, each then finishes token-identical,
    and no block stays held."""
    server = servers.get("grpc")
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    expected = _greedy(engine, messages, MAX_TOKENS_LONG)
    partition_s = 6.0
    decoding = threading.Barrier(len(QUESTIONS) + 1)

    def one(message):
        with server.client(timeout_s=180) as client:
            request = client.request(messages=message, max_tokens=MAX_TOKENS_LONG, temperature=0)
            token_ids, waited = [], False
            for response in client.stream(request):
                token_ids += list(response.token_ids)
                if len(token_ids) >= 3 and not waited:  # decoding on B
                    waited = True
                    decoding.wait(timeout=120)
            return token_ids, time.monotonic()

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(one, m) for m in messages]
        decoding.wait(timeout=120)  # every stream has tokens decoded on B
        hosts.link.partition()
        try:
            assert not hosts.reachable(timeout_s=1.0)
            time.sleep(partition_s - 1.0)
        finally:
            hosts.link.heal()
            healed_at = time.monotonic()
        results = [future.result(timeout=150) for future in futures]
    for reference, (token_ids, finished_at) in zip(expected, results):
        assert token_ids == reference.token_ids
        assert finished_at > healed_at
    assert_no_block_held(server.wait_idle())


@pytest.mark.timeout(300)
def test_a_partition_in_the_middle_of_a_handoff_stalls_it_and_the_request_finishes_identical(
    hosts, servers, engine
):
    """A long prompt's KV (~480 tokens, ~11 MB in fp32) crosses a link slowed to 20 Mbit/s, so its
    handoff takes seconds; the link drops every packet for 5 s from the request's first token (the
    handoff under way) on. The request finishes token-identical after the heal, and no block stays
    held on either side."""
    server = servers.get("grpc")
    text = "Rivers shaped where people settled, traded and fought over the centuries. " * 30
    message = [{"role": "user", "content": text + "Summarise this."}]
    (reference,) = _greedy(engine, [message], MAX_TOKENS)
    hosts.link.shape(rate="20mbit")
    try:
        with server.client(timeout_s=180) as client:
            request = client.request(messages=message, max_tokens=MAX_TOKENS, temperature=0)
            token_ids, final, healed_at = [], None, None
            for response in client.stream(request):
                token_ids += list(response.token_ids)
                final = response if response.finish_reason else final
                if healed_at is None:  # the first token: the prefill is done, the KV on its way
                    hosts.link.partition()
                    try:
                        assert not hosts.reachable(timeout_s=1.0)
                        time.sleep(4.0)
                    finally:
                        hosts.link.heal()
                        healed_at = time.monotonic()
        assert token_ids == reference.token_ids
        assert final.timings.kv_transfer_s > 4.0  # the handoff lasted through the partition
    finally:
        hosts.link.shape(rate="1gbit")
    assert_no_block_held(server.wait_idle())
