"""The OpenAI-compatible HTTP API of a live system (real Ray actors, loopback), driven by the
official `openai` client, against the gRPC path for the same greedy requests; and /metrics."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-data-key"
ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def served(harness):
    system = harness.start(
        num_prefill=1, num_decode=1, http_port=0, api_keys=(API_KEY,), admin_token=ADMIN_TOKEN
    )
    yield system
    system.stop()


@pytest.fixture(scope="module")
def client(served):
    return served.openai_client(API_KEY)


def grpc_client(served):
    from pdserve.client import PdserveClient

    return PdserveClient(port=served.port, timeout_s=120, api_key=API_KEY)


def http(served, method: str, path: str, body=None, headers=None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.system.http_port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def metric_samples(served) -> dict:
    status, _, body = http(served, "GET", "/metrics")
    assert status == 200
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def test_streamed_chat_equals_the_grpc_path(served, client):
    question = "Name three primary colors."
    chunks = list(
        client.chat.completions.create(
            model=served.config.model_name,
            messages=[{"role": "user", "content": question}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]

    with grpc_client(served) as grpc:
        reference = grpc.chat(question, max_tokens=24, temperature=0)
    assert text == reference.text and text
    assert reasons == [reference.finish_reason]
    assert usage.prompt_tokens == reference.usage.prompt_tokens > 5
    assert usage.completion_tokens == reference.usage.completion_tokens == len(reference.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_of_token_ids_and_text_equal_the_grpc_path(served, client):
    with grpc_client(served) as grpc:
        reference = grpc.generate(
            grpc.request("The capital of France is", max_tokens=12, temperature=0, ignore_eos=True)
        )
        prompt_ids = list(
            grpc.generate(grpc.request("Once upon a time", max_tokens=1, temperature=0)).token_ids
        )
    whole = client.completions.create(
        model=served.config.model_name,
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == reference.text
    assert whole.choices[0].finish_reason == "length"
    assert (
        whole.usage.completion_tokens == 12
        and whole.usage.prompt_tokens == reference.usage.prompt_tokens
    )
    assert whole.object == "text_completion" and whole.model == served.config.model_name

    by_ids = client.completions.create(
        model=served.config.model_name,
        prompt=[1, 504, 3458] + prompt_ids,
        max_tokens=5,
        temperature=0,
    )
    assert by_ids.usage.prompt_tokens == 3 + len(prompt_ids)
    assert by_ids.choices[0].text


def test_non_streamed_chat_and_streamed_completion_agree(served, client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    whole = client.chat.completions.create(
        model=served.config.model_name, messages=messages, max_tokens=16, temperature=0
    )
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=served.config.model_name,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert (
        whole.choices[0].message.content == streamed
        and whole.choices[0].message.role == "assistant"
    )
    assert whole.usage.completion_tokens >= 1

    status, headers, body = http(
        served,
        "POST",
        "/v1/completions",
        {
            "model": served.config.model_name,
            "prompt": "Hello",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
        {"Authorization": f"Bearer {API_KEY}"},
    )
    events = [line.removeprefix("data: ") for line in body.decode().split("\n\n") if line]
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_requests_get_400_in_the_openai_shape(served, client):
    model = served.config.model_name
    cases = [
        (dict(messages=[{"role": "user", "content": "hi"}], temperature=-1), "temperature"),
        (dict(messages=[{"role": "user", "content": "hi"}], top_p=0), "top_p"),
        (dict(messages=[{"role": "user", "content": "hi"}], n=17), "n"),
        (dict(messages=[], max_tokens=4), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, **arguments)
        assert caught.value.status_code == 400
        assert caught.value.body["param"] == param and param in caught.value.body["message"]
        assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["param"] == "model"


def test_models_health_and_unknown_routes(served, client):
    assert [m.id for m in client.models.list().data] == [served.config.model_name]
    assert http(served, "GET", "/health")[0] == 200
    status, _, body = http(served, "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_metrics_count_each_request_and_show_the_pools(served, client):
    ttft_count = "pdserve_time_to_first_token_seconds_count{}"
    before = metric_samples(served)
    for expected in (1, 2):
        client.completions.create(
            model=served.config.model_name, prompt="One, two,", max_tokens=3, temperature=0
        )
        after = metric_samples(served)
        assert after[ttft_count] == before.get(ttft_count, 0) + expected
    assert (
        after['pdserve_requests_total{"outcome": "length"}']
        >= before['pdserve_requests_total{"outcome": "length"}'] + 2
    )
    assert after['pdserve_workers{"role": "decode", "state": "ready"}'] == 1
    assert after['pdserve_workers{"role": "prefill", "state": "ready"}'] == 1
    kv_bytes = after["pdserve_kv_transfer_bytes_count{}"]
    assert kv_bytes >= 2 and after["pdserve_kv_transfer_bytes_sum{}"] > 0
    gpu = [key for key in after if key.startswith("pdserve_worker_gpu_available")]
    assert len(gpu) == 2  # one per worker, 0 here; the info series says why
    assert any(key.startswith("pdserve_worker_gpu_info") and "GPU" in key for key in after)
    usage = [
        value
        for key, value in after.items()
        if key.startswith("pdserve_worker_kv_cache_usage_ratio")
    ]
    assert len(usage) == 2 and all(0.0 <= value <= 1.0 for value in usage)
    # the costs the PD policy reads: the prefill worker's rate per prompt token, and every worker's
    # slack, unbounded with nothing decoding any more
    rate = [v for k, v in after.items() if k.startswith("pdserve_worker_prefill_token_seconds")]
    assert len(rate) == 1 and 0 < rate[0] < 1, rate
    slack = [v for k, v in after.items() if k.startswith("pdserve_worker_decode_slack_seconds")]
    assert slack == [math.inf, math.inf], slack
