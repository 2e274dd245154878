"""`pdserve bench --dataset conversation`: the scripts are reproducible, every turn resends the
whole history with the replies the server really gave, users start on the arrival schedule and pause
their think time, the per-turn figures by hand, the flags, and one small run against a live local
system over gRPC and the OpenAI chat API."""

import argparse
import asyncio
import json
import math

import numpy as np
import pytest

from pdserve.bench import (
    BenchConfig,
    RequestRecord,
    add_parser,
    arrival_times_s,
    config_from_args,
    conversations,
    run_conversations,
    sweep,
)
from pdserve.bench_backends import GrpcBackend
from pdserve.bench_metrics import compute_metrics, format_result, per_turn_metrics


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizer import load_tokenizer

    return load_tokenizer("default")


def _config(**overrides) -> BenchConfig:
    return BenchConfig(
        **{
            "dataset": "conversation",
            "users": 3,
            "turns": 3,
            "system_prompt_len": 24,
            "turn_input_len": 8,
            "random_output_len": 4,
            "disable_tqdm": True,
            **overrides,
        }
    )


# -- the scripts -----------------------------------------------------------------------------


def test_scripts_are_reproducible_for_a_seed_and_share_one_system_prompt(tokenizer):
    config = _config(users=4, think_time_s=0.5, seed=3)
    scripts = conversations(tokenizer, config)
    assert scripts == conversations(tokenizer, config)
    assert len(scripts) == 4 and all(
        len(s.user_messages) == 3 and len(s.think_times_s) == 2 for s in scripts
    )
    assert len({s.system_prompt for s in scripts}) == 1 and all(s.output_len == 4 for s in scripts)
    assert abs(len(tokenizer.encode(scripts[0].system_prompt, add_special_tokens=False)) - 24) <= 1
    messages = [m for s in scripts for m in s.user_messages]
    assert len(set(messages)) == 12  # fresh text every turn of every user
    assert all(abs(len(tokenizer.encode(m, add_special_tokens=False)) - 8) <= 1 for m in messages)
    # Another seed: other texts and think times.
    other = conversations(tokenizer, _config(users=4, think_time_s=0.5, seed=4))
    assert (
        other[0].system_prompt != scripts[0].system_prompt
        and other[0].think_times_s != scripts[0].think_times_s
    )
    # A sweep's next rate: fresh texts, the same think times; a user's script does not depend on the
    # user count.
    next_rate = conversations(tokenizer, config, content_index=1)
    assert [s.think_times_s for s in next_rate] == [s.think_times_s for s in scripts]
    assert (
        not set(next_rate[0].user_messages) & set(messages)
        and next_rate[0].system_prompt != scripts[0].system_prompt
    )
    assert conversations(tokenizer, _config(users=2, think_time_s=0.5, seed=3)) == scripts[:2]


def test_think_times_are_exponential_with_the_mean_and_zero_when_off(tokenizer):
    scripts = conversations(
        tokenizer,
        _config(users=200, turns=11, turn_input_len=1, system_prompt_len=0, think_time_s=2.0),
    )
    pauses = np.array([t for s in scripts for t in s.think_times_s])
    assert pauses.size == 2000 and (pauses >= 0).all() and scripts[0].system_prompt == ""
    assert (
        pauses.mean() == pytest.approx(2.0, rel=0.1) and 0.85 < pauses.std() / pauses.mean() < 1.15
    )
    assert all(t == 0.0 for s in conversations(tokenizer, _config()) for t in s.think_times_s)


# -- playing them ----------------------------------------------------------------------------


class _ChatBackend:
    """Answers each request after `reply_s` with a reply naming the request's number and last
    message, `prompt_len` 10 and `kv_bytes` 1000 per message sent; remembers every request's
    messages; fails a request whose last message is one of `fail_messages`."""

    def __init__(self, reply_s: float = 0.01, fail_messages: frozenset = frozenset()):
        self.reply_s = reply_s
        self.fail_messages = fail_messages
        self.sent: list[tuple] = []

    async def send(self, prompt, clock):
        self.sent.append(prompt.messages)
        number = len(self.sent)
        if prompt.messages[-1][1] in self.fail_messages:
            return clock.record(0, error="UNAVAILABLE: gone")
        clock.chunk(1)
        await asyncio.sleep(self.reply_s)
        clock.chunk(1)
        reply = f"reply {number} to {prompt.messages[-1][1][:10]!r}"
        return clock.record(
            2,
            prompt_len=10 * len(prompt.messages),
            kv_bytes=1000 * len(prompt.messages),
            reply_text=reply,
        )


def test_every_turn_sends_the_whole_history_with_the_real_replies(tokenizer):
    config = _config()
    scripts = conversations(tokenizer, config)
    backend = _ChatBackend()
    result = asyncio.run(run_conversations(config, backend, scripts, math.inf))
    assert result["completed"] == 9 and result["failed"] == 0
    assert result["requests"]["turns"] == [1, 2, 3] * 3  # user by user, turn by turn
    for script in scripts:
        mine = [m for m in backend.sent if m[1] == ("user", script.user_messages[0])]
        # system + (user, assistant) per earlier turn + user
        assert [len(m) for m in mine] == [2, 4, 6]
        for turn, messages in enumerate(mine):
            assert messages[0] == ("system", script.system_prompt)
            assert [content for role, content in messages if role == "user"] == list(
                script.user_messages[: turn + 1]
            )
            assert [role for role, _ in messages] == [
                "system",
                *["user", "assistant"] * turn,
                "user",
            ]
            # the earlier request's messages, the reply it really got, then the new message
            if turn:
                reply_index = backend.sent.index(mine[turn - 1]) + 1
                assert messages[:-1] == (
                    *mine[turn - 1],
                    ("assistant", f"reply {reply_index} to {mine[turn - 1][-1][1][:10]!r}"),
                )
    # The per-turn figures follow the fake's numbers: 20, 40, 60 prompt tokens; 2000, 4000, 6000 KV
    # bytes.
    per_turn = result["per_turn"]
    assert [t["turn"] for t in per_turn] == [1, 2, 3] and all(t["completed"] == 3 for t in per_turn)
    assert [t["mean_input_tokens"] for t in per_turn] == [20, 40, 60]
    assert [t["mean_kv_bytes"] for t in per_turn] == [2000, 4000, 6000]
    assert all(t["mean_cached_prompt_tokens"] is None for t in per_turn)  # the fake reports none
    assert all(t["p99_ttft_ms"] >= t["p50_ttft_ms"] >= 0 for t in per_turn)


def test_users_arrive_on_the_schedule_and_pause_their_think_time(tokenizer):
    config = _config(users=3, turns=2, think_time_s=0.05, seed=5)
    scripts = conversations(tokenizer, config)
    result = asyncio.run(
        run_conversations(config, _ChatBackend(reply_s=0.02), scripts, 10.0, arrival_seed=5)
    )
    requests = result["requests"]
    starts, ends = (
        requests["start_times_s"],
        [s + e for s, e in zip(requests["start_times_s"], requests["e2els_s"])],
    )
    for user, (script, arrival_s) in enumerate(zip(scripts, arrival_times_s(3, 10.0, seed=5))):
        first, second = 2 * user, 2 * user + 1
        assert arrival_s - 0.001 <= starts[first] < arrival_s + 0.1
        # The second turn waits for the first reply's end plus the think time, and not much longer.
        assert (
            ends[first] + script.think_times_s[0] - 0.001
            <= starts[second]
            < ends[first] + script.think_times_s[0] + 0.1
        )
    assert result["completed"] == 6 and [t["completed"] for t in result["per_turn"]] == [3, 3]


def test_a_failed_turn_ends_its_conversation(tokenizer):
    config = _config()
    scripts = conversations(tokenizer, config)
    # user 2's second turn
    backend = _ChatBackend(fail_messages=frozenset({scripts[1].user_messages[1]}))
    result = asyncio.run(run_conversations(config, backend, scripts, math.inf))
    assert (result["completed"], result["failed"]) == (7, 1) and result["distinct_errors"] == [
        "UNAVAILABLE: gone"
    ]
    assert result["requests"]["turns"] == [1, 2, 3, 1, 2, 1, 2, 3]  # user 2 never sends turn 3
    assert [(t["completed"], t["failed"]) for t in result["per_turn"]] == [(3, 0), (2, 1), (2, 0)]


# -- the figures -----------------------------------------------------------------------------


def _turn_records() -> list[RequestRecord]:
    def record(turn, ttft_s, prompt_len, kv_bytes=None, cached=None, success=True):
        return RequestRecord(
            success,
            prompt_len,
            output_len=4 if success else 0,
            ttft_s=ttft_s if success else None,
            itls_s=[],
            e2el_s=1.0,
            start_s=0.0,
            error="" if success else "boom",
            kv_bytes=kv_bytes,
            cached_prompt_tokens=cached,
            turn=turn,
        )

    return [
        record(1, 0.1, 100, 4096, 0),
        record(1, 0.3, 110, 8192, 0),
        record(1, 0.2, 90, 6144, 0),
        record(2, 0.05, 200, 1024, 96),
        record(2, 0.15, 220, None, None),
        record(2, 9.0, 210, 1 << 30, 5, success=False),
        # the last: no turn, left out
        record(3, 0.4, 300),
        RequestRecord(True, 1, 1, 0.01, [], 0.1, 0.0),
    ]


def test_per_turn_figures_by_hand():
    turn1, turn2, turn3 = per_turn_metrics(_turn_records(), percentiles=(50, 99))
    assert (turn1["turn"], turn1["completed"], turn1["failed"]) == (1, 3, 0)
    assert turn1["mean_input_tokens"] == pytest.approx(100)
    assert turn1["p50_ttft_ms"] == pytest.approx(200) and turn1["p99_ttft_ms"] == pytest.approx(298)
    assert turn1["mean_kv_bytes"] == pytest.approx(6144) and turn1["mean_cached_prompt_tokens"] == 0
    # Turn 2: the failed request counts only as failed; KV and cached tokens average over those
    # reporting them.
    assert (turn2["completed"], turn2["failed"]) == (2, 1)
    assert turn2["mean_input_tokens"] == pytest.approx(210)
    assert turn2["p50_ttft_ms"] == pytest.approx(100) and turn2["p99_ttft_ms"] == pytest.approx(149)
    assert turn2["mean_kv_bytes"] == pytest.approx(1024) and turn2[
        "mean_cached_prompt_tokens"
    ] == pytest.approx(96)
    # Turn 3 reports neither: None, not 0.
    assert turn3["mean_kv_bytes"] is None and turn3["mean_cached_prompt_tokens"] is None
    assert turn3["p50_ttft_ms"] == turn3["p99_ttft_ms"] == pytest.approx(400)
    assert per_turn_metrics([r for r in _turn_records() if r.turn is None]) == []


def test_the_printed_table_has_a_row_per_turn():
    records = _turn_records()
    result = {
        "request_rate": math.inf,
        "burstiness": 1.0,
        "max_concurrency": None,
        "distinct_errors": ["boom"],
        **compute_metrics(records, 2.0),
        "per_turn": per_turn_metrics(records),
    }
    printed = format_result(result, _config())
    rows = printed.split("Per turn of the conversations")[1].splitlines()
    assert rows[1].split() == [
        "turn",
        "done",
        "in",
        "tok",
        "TTFT",
        "p50/p99",
        "ms",
        "KV",
        "MiB",
        "cached",
    ]
    assert rows[2].split() == ["1", "3", "100", "200.0/298.0", "0.01", "0"]
    assert rows[3].split() == ["2", "2", "210", "100.0/149.0", "0.00", "96"]
    assert rows[4].split() == ["3", "1", "300", "400.0/400.0", "n/a", "n/a"]


# -- the flags -------------------------------------------------------------------------------


def test_flags_and_their_checks():
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "bench",
            "--backend",
            "openai-chat",
            "--dataset",
            "conversation",
            "--users",
            "5",
            "--turns",
            "6",
            "--system-prompt-len",
            "300",
            "--turn-input-len",
            "40",
            "--think-time-s",
            "1.5",
            "--random-output-len",
            "16",
            "--request-rate",
            "0.5",
        ]
    )
    config = config_from_args(args)
    assert (
        config.dataset,
        config.users,
        config.turns,
        config.system_prompt_len,
        config.turn_input_len,
        config.think_time_s,
        config.random_output_len,
        config.request_rates,
    ) == ("conversation", 5, 6, 300, 40, 1.5, 16, (0.5,))
    assert (
        config_from_args(parser.parse_args(["bench", "--dataset-name", "conversation"])).dataset
        == "conversation"
    )
    with pytest.raises(ValueError, match="--dataset conversation sends chat messages: --backend"):
        BenchConfig(dataset="conversation", backend="openai")
    for flag, overrides in (
        ("--users", {"users": 0}),
        ("--turns", {"turns": 0}),
        ("--think-time-s", {"think_time_s": -1}),
        ("--turn-input-len", {"turn_input_len": 0}),
        ("--system-prompt-len", {"system_prompt_len": -1}),
        ("--dataset", {"dataset": "sharegpt"}),
    ):
        with pytest.raises(ValueError, match=flag):
            _config(**overrides)


# -- live ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def system(harness):
    """1 prefill + 1 decode, every request through the prefill pool (KV shipped), gRPC and HTTP."""
    running = harness.start(num_prefill=1, num_decode=1, http_port=0)
    yield running
    running.stop()


@pytest.mark.parametrize("backend", ["grpc", "openai-chat"])
def test_conversations_against_a_live_system(
    system, tokenizer, backend, tmp_path, capsys, monkeypatch
):
    # (messages, reply) of every gRPC request, to check the history against the real replies
    sent = []
    send = GrpcBackend.send

    async def spy(self, prompt, clock):
        record = await send(self, prompt, clock)
        sent.append((prompt.messages, record.reply_text))
        return record

    monkeypatch.setattr(GrpcBackend, "send", spy)
    result_file = tmp_path / f"{backend}.json"
    port = system.port if backend == "grpc" else system.system.http_port
    config = _config(
        backend=backend,
        port=port,
        users=2,
        turns=2,
        system_prompt_len=16,
        turn_input_len=8,
        random_output_len=4,
        result_file=str(result_file),
    )
    sweep(config, tokenizer=tokenizer)
    (result,) = json.loads(result_file.read_text())["results"]
    assert (result["completed"], result["failed"]) == (4, 0), result["distinct_errors"]
    assert result["total_output_tokens"] == 16 and result["requests"]["turns"] == [1, 2, 1, 2]
    first, second = result["per_turn"]
    assert (first["turn"], first["completed"], second["turn"], second["completed"]) == (1, 2, 2, 2)
    assert first["p50_ttft_ms"] > 0 and second["p99_ttft_ms"] >= second["p50_ttft_ms"] > 0
    # Turn 2 resends turn 1's prompt and its 4-token reply before the new 8-token message.
    assert second["mean_input_tokens"] >= first["mean_input_tokens"] + 4 + 8
    assert first["mean_cached_prompt_tokens"] is not None  # pdserve reports it on both APIs
    if backend == "grpc":
        # turn 2 has new blocks to ship at least
        assert first["mean_kv_bytes"] > 0 and second["mean_kv_bytes"] > 0
        replies = dict(sent)
        assert len(sent) == 4 and all(replies.values())  # the server's text, as streamed
        for messages in replies:
            # turn 2: turn 1's messages, the reply turn 1 really got, the new message
            if len(messages) > 2:
                assert messages[2] == ("assistant", replies[messages[:2]])
    else:
        # HTTP cannot know
        assert first["mean_kv_bytes"] is None and second["mean_kv_bytes"] is None
    assert "Per turn of the conversations" in capsys.readouterr().out
