"""pdserve across two hosts when the link between them is slow, partitioned past Ray's node timeout,
or host B's node dies (tests/two_hosts.py: two network namespaces on this machine; the router and
the prefill pool on host A, the decode pool on host B).

- A slow link (50 Mbit/s): once the router learnt the link from one handoff, a prompt whose KV
  would miss the TTFT target on the wire prefills on its decode worker on B (reason "link").
- A partition longer than the head's node timeout: the system serves degraded (the decode pool's
  replacement on host A), says so (`status`, `pdserve_degraded`), and when the link heals, B's node
  comes back by itself (`pdserve node`) and the decode pool moves back to B.
- Host B's node killed (every process on it but its supervisor): in-flight streams migrate or fail
  with UNAVAILABLE within a bound, the system serves degraded, then B's node and pool come back.

Every test checks the output is the engine's and no worker holds a KV block afterwards. The
cluster's head marks a silent node dead after ~5 s (`FAST_NODE_TIMEOUT_ENV`; Ray's default ~40 s).
Needs root: without it the module fails, it does not skip. Delay, jitter and loss need sch_netem,
which this repo's CI kernels lack: not tested here (`Link.netem_available`).
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.two_hosts import TwoHosts, assert_no_block_held

MAX_TOKENS = 8
MAX_TOKENS_LONG = 48
PROMPT_TOKENS = 512  # fp32: 23.6 MB of KV, ~3.8 s at 50 Mbit/s
SLOW_RATE = "50mbit"
# the prefill pool computes 512 tokens in ~1.5 s here (up to ~3 s on a busy machine): it meets
# 4 s, the KV on the slow link does not
SLOW_LINK_SLO = "ttft:4000,tpot:1000"
HTTP_PORT = 8080
QUESTIONS = ["What is the capital of France?", "Name three rivers in Europe."]


@pytest.fixture(scope="module")
def hosts():
    hosts = TwoHosts.create(rate="1gbit")  # fails the module (no skip) where it cannot
    try:
        hosts.start_ray(head_cpus=2, node_cpus=1, supervise_node=True, fast_node_timeout=True)
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def engine(smollm_fp32):
    return LLMEngine(EngineConfig(kv_cache_bytes=64 << 20), loaded=smollm_fp32)


def _serve(hosts, *args):
    return hosts.serve(
        "--transport=grpc",
        "--dtype=float32",
        "--kv-cache-mib=64",
        "--lend-cores=off",  # the two hosts' workers share this machine's cores
        "--prefill=1",
        "--decode=1",
        f"--http-port={HTTP_PORT}",
        *args,
    )


def _wait(what: str, check, timeout_s: float, period_s: float = 0.5):
    """`check()` until it returns something true; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(period_s)


def _metrics(server) -> str:
    url = f"http://{server.host}:{HTTP_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _sample(metrics: str, name: str, **labels) -> float:
    """The value of one series (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _status(server) -> str:
    pdserve = str(Path(sys.executable).with_name("pdserve"))
    done = subprocess.run(
        [pdserve, "status", f"--host={server.host}", f"--port={server.port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _where(hosts, stats) -> dict[str, str]:
    """Ready worker id -> the address of its node (None for a node the head lists as dead)."""
    nodes = hosts.alive_nodes()
    return {
        w.worker_id: next((ip for node, ip in nodes.items() if node.startswith(w.node)), None)
        for w in stats.workers
        if w.state == "ready"
    }


def _decode_on(hosts, server, address: str):
    """The stats once every ready decode worker is on `address` and one at least is, nothing
    else in the decode pool (draining ones gone)."""
    try:
        with server.client() as client:
            stats = client.stats()
    except grpc.RpcError:  # a worker's load call waits for the head's word on a silent node
        return None
    decode = [w for w in stats.workers if w.role == "decode"]
    where = _where(hosts, stats)
    if decode and all(w.state == "ready" and where.get(w.worker_id) == address for w in decode):
        return stats
    return None


def _chat(server, question: str, max_tokens: int = MAX_TOKENS):
    with server.client(timeout_s=120) as client:
        return client.chat(question, max_tokens=max_tokens, temperature=0)


def _greedy(engine, questions, max_tokens=MAX_TOKENS):
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return {q: r.token_ids for q, r in zip(questions, results)}


@pytest.mark.timeout(300)
def test_a_slow_link_makes_the_decode_host_prefill(hosts, engine):
    """At 50 Mbit/s a 512-token prompt's KV takes ~3.8 s on the wire: the first request learns the
    link (remote, its KV crossing), the next ones prefill on B's decode worker, reason "link"."""
    rng = random.Random(52)
    prompts = [[rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(3)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    hosts.link.shape(rate=SLOW_RATE)
    server = _serve(hosts, "--pd-policy=auto", f"--slo={SLOW_LINK_SLO}")
    try:
        completions = []
        with server.client(timeout_s=120) as client:
            for prompt in prompts:
                request = client.request(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0)
                completions.append(client.generate(request))
        for completion, reference in zip(completions, expected):
            assert completion.token_ids == reference.token_ids
        first, *later = completions
        assert first.prefill_worker == "prefill-0" and first.decode_worker == "decode-0"
        assert first.timings.kv_bytes > 20e6, first.timings
        for completion in later:  # prefilled where it decodes: nothing crossed
            assert completion.decode_worker == "decode-0" and completion.timings.kv_bytes == 0, (
                completion
            )
        metrics = _metrics(server)
        assert _sample(metrics, "pdserve_pd_decision_total", path="local", reason="link") == 2
        bandwidth = _sample(metrics, "pdserve_link_bandwidth_bytes_per_second")
        assert 1e6 < bandwidth < 6.25e6 * 1.1, bandwidth  # the link's rate at most
        status = _status(server)
        assert re.search(r"link \S+ -> \S+: 0\.0\d Gbit/s", status), status
        assert_no_block_held(server.wait_idle())
        print(f"slow link: learnt {bandwidth * 8 / 1e6:.1f} Mbit/s; {status}")
    finally:
        server.stop()
        hosts.link.shape(rate="1gbit")


@pytest.fixture(scope="module")
def faults_server(hosts):
    """The partition and node-death tests' server (one for both): every request through the
    prefill pool while there is one, so a request served on B is a handoff across the link."""
    server = _serve(hosts, "--pd-policy=remote")
    yield server
    server.stop()


def _assert_degraded(server, pool: str):
    status = _status(server)
    assert f"degraded: {pool}:" in status, status
    assert _sample(_metrics(server), "pdserve_degraded", pool=pool) == 1.0


def _assert_healthy(server):
    status = _status(server)
    assert "degraded" not in status, status
    metrics = _metrics(server)
    assert _sample(metrics, "pdserve_degraded", pool="decode") == 0.0
    assert _sample(metrics, "pdserve_degraded", pool="prefill") == 0.0


def _recovers_on_b(hosts, server, engine, expected, since_s: float) -> None:
    """B's node alive again (its supervisor restarted it), the decode pool back on B, a request
    served across the link with the engine's output, and every block free."""
    _wait("B's node alive again", lambda: hosts.b in hosts.alive_nodes().values(), 90)
    back_s = time.monotonic() - since_s
    _wait("the decode pool back on B", lambda: _decode_on(hosts, server, hosts.b), 150, 1.0)
    completion = _chat(server, QUESTIONS[1])
    assert completion.token_ids == expected[QUESTIONS[1]]
    assert completion.prefill_worker == "prefill-0" and completion.timings.kv_bytes > 0, completion
    _assert_healthy(server)
    assert_no_block_held(server.wait_idle())
    print(f"B's node back {back_s:.1f} s after; pool on B {time.monotonic() - since_s:.1f} s")


@pytest.mark.timeout(400)
def test_a_partition_past_the_node_timeout_serves_degraded_then_heals_by_itself(
    hosts, faults_server, engine
):
    server = faults_server
    expected = _greedy(engine, QUESTIONS)
    assert _chat(server, QUESTIONS[0]).token_ids == expected[QUESTIONS[0]]
    assert _decode_on(hosts, server, hosts.b)
    _assert_healthy(server)
    hosts.link.partition()
    try:
        started = time.monotonic()
        _wait("B marked dead", lambda: hosts.b not in hosts.alive_nodes().values(), 30)
        dead_s = time.monotonic() - started
        # the decode pool's replacement runs on A: degraded, and serving
        _wait("a decode worker on A", lambda: _decode_on(hosts, server, hosts.a), 120, 1.0)
        _assert_degraded(server, "decode")
        completion = _chat(server, QUESTIONS[0])
        assert completion.token_ids == expected[QUESTIONS[0]]
        print(
            f"partition: B dead after {dead_s:.1f} s; degraded serving after "
            f"{time.monotonic() - started:.1f} s"
        )
    finally:
        hosts.link.heal()
    _recovers_on_b(hosts, server, engine, expected, time.monotonic())


@pytest.mark.timeout(400)
def test_host_b_s_node_death_migrates_or_fails_cleanly_then_the_pool_refills(
    hosts, faults_server, engine
):
    server = faults_server
    expected = _greedy(engine, QUESTIONS)
    expected_long = _greedy(engine, QUESTIONS, MAX_TOKENS_LONG)
    _wait("the decode pool on B", lambda: _decode_on(hosts, server, hosts.b), 60, 1.0)
    decoding = threading.Barrier(len(QUESTIONS) + 1)

    def one(question):
        token_ids, waited = [], False
        try:
            with server.client(timeout_s=120) as client:
                request = client.request(
                    messages=[{"role": "user", "content": question}],
                    max_tokens=MAX_TOKENS_LONG,
                    temperature=0,
                )
                for response in client.stream(request):
                    token_ids += list(response.token_ids)
                    if len(token_ids) >= 2 and not waited:  # decoding on B
                        waited = True
                        decoding.wait(timeout=120)
            return token_ids, None, time.monotonic()
        except grpc.RpcError as error:
            return token_ids, error, time.monotonic()

    supervisor = next(c for c in hosts.processes if c.name == "ray-node").process.pid
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(one, q) for q in QUESTIONS]
        decoding.wait(timeout=120)
        killed_at = time.monotonic()
        assert hosts.kill_node("b", spare=(supervisor,))
        results = [future.result(timeout=120) for future in futures]
    for question, (token_ids, error, ended_at) in zip(QUESTIONS, results):
        assert ended_at - killed_at < 60, (question, ended_at - killed_at)
        if error is None:  # migrated: the stream continued exactly
            assert token_ids == expected_long[question]
        else:  # a clean failure, naming the pool
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert "decode" in error.details(), error.details()
            assert token_ids == expected_long[question][: len(token_ids)]
    outcomes = ["migrated" if error is None else "UNAVAILABLE" for _, error, _ in results]
    print(f"node death: in-flight streams {outcomes}")
    _wait("a decode worker on A", lambda: _decode_on(hosts, server, hosts.a), 120, 1.0)
    _assert_degraded(server, "decode")
    assert _chat(server, QUESTIONS[0]).token_ids == expected[QUESTIONS[0]]
    _recovers_on_b(hosts, server, engine, expected, killed_at)
