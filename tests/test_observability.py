"""What an operator sees of a live 1P+1D system (real Ray actors, loopback): the access log's line
per HTTP request and gRPC call, refusals included, and the shipped Grafana dashboard, each of whose
queries runs against a real Prometheus (Debian's, installed by scripts/install_prometheus.sh)
scraping the system under load."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.client import PdserveClient
from router.trace_context import trace_id_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# what the dashboard's $__rate_interval becomes here: wider than the whole test
RATE_WINDOW = "2m"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span exported to it."""

    def __init__(self):
        self.spans: list = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, names: set[str], timeout_s: float = 15) -> dict:
        """The spans of one trace by name, once those named have all come."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = {s.name: s for s in self.spans if s.trace_id == bytes.fromhex(trace_id)}
            if names <= set(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


@pytest.fixture(scope="module")
def collector():
    collector = Collector()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    collector.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector
    server.stop(grace=None)


@pytest.fixture(scope="module")
def served(harness, collector):
    system = harness.start(
        num_prefill=1, num_decode=1, http_port=0, otlp_endpoint=f"127.0.0.1:{collector.port}"
    )
    yield system
    system.stop()


def http(served, method: str, path: str, body=None, headers=None) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.system.http_port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def access_lines(caplog, wanted: int, timeout_s: float = 10) -> list[str]:
    """The access log's lines so far, once there are `wanted` (a streamed answer's line is written
    after its last byte left)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.access"]
        if len(lines) >= wanted or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_access_log_has_a_line_per_request_refusals_included(served, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.access")
    completion = {"model": served.config.model_name, "prompt": "Hello", "max_tokens": 4}
    headers = {"X-Request-Id": "access-ok", "traceparent": TRACEPARENT}
    assert http(served, "POST", "/v1/completions", completion, headers) == 200
    bad = {**completion, "max_tokens": -1}
    assert http(served, "POST", "/v1/completions", bad, {"X-Request-Id": "access-bad"}) == 400
    assert http(served, "GET", "/tokenizer_info") == 404
    with PdserveClient(port=served.port, timeout_s=120) as client:
        done = client.generate(client.request("Hello", request_id="access-grpc", max_tokens=4))
        assert done.finish_reason
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(client.request("Hello", request_id="access-grpc-bad", temperature=-1.0))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    lines = access_lines(caplog, 5)
    assert len(lines) == 5, lines
    ok, bad_line, missing, grpc_ok, grpc_bad = lines
    assert ok.startswith("http POST /v1/completions 200 ")
    assert "request_id=access-ok" in ok and "trace_id=4bf92f3577b34da6a3ce929d0e0e4736" in ok
    assert bad_line.startswith("http POST /v1/completions 400 ")
    assert "request_id=access-bad" in bad_line
    assert missing.startswith("http GET /tokenizer_info 404 ") and "trace_id=-" in missing
    assert grpc_ok.startswith("grpc /pdserve.v1.Generation/Generate OK ")
    assert "request_id=access-grpc " in grpc_ok
    assert re.search(r"trace_id=[0-9a-f]{32}$", grpc_ok)  # the trace the router started
    assert grpc_bad.startswith("grpc /pdserve.v1.Generation/Generate INVALID_ARGUMENT ")
    latency_s = float(ok.split()[4].rstrip("s"))
    assert 0 < latency_s < 120


# -- the dashboard against a real Prometheus ---------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = [
        (panel["title"], target["expr"].replace("$__rate_interval", RATE_WINDOW))
        for panel in panels
        if panel["type"] != "row"
        for target in panel["targets"]
    ]
    assert len(queries) > 20
    return queries


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prometheus_query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory):
    """A Prometheus on loopback scraping the system's /metrics every second; yields its port."""
    installed = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install_prometheus.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    directory = tmp_path_factory.mktemp("prometheus")
    config = directory / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        "  - job_name: pdserve\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{served.system.http_port}']\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(directory / "prometheus.log", "w"),
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if prometheus_query(port, "up"):
                    break
            except (OSError, urllib.error.URLError):
                pass
            assert process.poll() is None, (directory / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus did not scrape within 30 s"
            time.sleep(0.25)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_every_dashboard_panel_returns_data(served, prometheus):
    shared = "Tell me about the sea, its tides and the moon that moves them. " * 6

    def ask(index: int) -> str:
        with PdserveClient(port=served.port, timeout_s=120) as client:
            # a shared prefix of a few blocks: handoffs move KV, later prompts hit the cache
            return client.generate(client.request(f"{shared}{index}", max_tokens=8)).finish_reason

    assert ask(0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(pool.map(ask, range(1, 6)))
    # Prometheus has scraped after the load once every router-side series shows it
    deadline = time.monotonic() + 20
    while not prometheus_query(
        prometheus, "pdserve_slo_requests_total > 0 and on() pdserve_link_handoffs > 0"
    ):
        assert time.monotonic() < deadline, "no scrape after the load"
        time.sleep(0.5)
    time.sleep(1.5)  # one more scrape, so every rate() has two samples after the load
    empty = []
    for title, expr in dashboard_queries():
        result = prometheus_query(prometheus, expr)
        values = [float(series["value"][1]) for series in result]
        if not any(not math.isnan(value) for value in values):
            empty.append(f"{title}: {expr} -> {result}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_a_renamed_metric_leaves_its_panel_without_data(prometheus):
    """The check above can fail: a query of a metric the router does not export returns nothing."""
    assert prometheus_query(prometheus, "pdserve_time_to_first_token_seconds_bucket")
    assert not prometheus_query(prometheus, "pdserve_time_to_first_token_secs_bucket")


# -- traces ------------------------------------------------------------------------------------

PHASES = {"admission_queue", "prefill", "kv_transfer", "decode"}


def check_trace(collector: Collector, trace_id: str, parent_span_id: str) -> None:
    spans = collector.trace(trace_id, {"pdserve.request"} | PHASES)
    assert {"pdserve.request"} | PHASES <= set(spans), sorted(spans)
    root = spans["pdserve.request"]
    assert root.parent_span_id == bytes.fromhex(parent_span_id)  # the client's span
    for name in PHASES:
        assert spans[name].parent_span_id == root.span_id, name
    queue, prefill, transfer, decode = (
        spans[name] for name in ("admission_queue", "prefill", "kv_transfer", "decode")
    )
    assert root.start_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano + 1
    assert prefill.end_time_unix_nano <= transfer.start_time_unix_nano + 1
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano + 1
    assert decode.end_time_unix_nano <= root.end_time_unix_nano
    attributes = {
        span.name: {a.key: a.value for a in span.attributes} for span in (root, prefill, transfer)
    }
    assert attributes["kv_transfer"]["pdserve.kv.bytes"].int_value > 0
    assert attributes["prefill"]["pdserve.prompt_tokens"].int_value > 0
    assert attributes["pdserve.request"]["pdserve.pd.path"].string_value == "remote"
    assert attributes["pdserve.request"]["pdserve.pd.reason"].string_value  # the policy's reason


def test_a_traced_request_has_its_phases_as_spans_under_the_clients_span(served, collector):
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    completion = {"model": served.config.model_name, "prompt": "Hello there", "max_tokens": 4}
    headers = {"traceparent": f"00-{trace_id}-{parent}-01"}
    assert http(served, "POST", "/v1/completions", completion, headers) == 200
    check_trace(collector, trace_id, parent)

    trace_id, parent = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    with PdserveClient(port=served.port, timeout_s=120) as client:
        stream = client.stub.Generate(
            client.request("Hello there", max_tokens=4),
            timeout=120,
            metadata=(("traceparent", f"00-{trace_id}-{parent}-01"),),
        )
        assert [r.finish_reason for r in stream][-1]
    check_trace(collector, trace_id, parent)


def test_tracing_off_imports_no_opentelemetry():
    """Without --otlp-endpoint the front ends hold no tracer, and serving loads no SDK."""
    code = (
        "import sys, router.http_server, router.grpc_server, pdserve.system\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_trace_ids_of_traceparents():
    assert trace_id_of(TRACEPARENT) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_of(TRACEPARENT.upper()) == "4bf92f3577b34da6a3ce929d0e0e4736"
    for bad in (None, "", "00-xyz", "ff" + TRACEPARENT[2:], "00-" + "0" * 32 + TRACEPARENT[35:]):
        assert trace_id_of(bad) is None, bad
