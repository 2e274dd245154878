"""The OpenAI layer's reading of penalties, biases, batched prompts and stream options, and the
validator's limits on them, without a running system (issue #55)."""

import pytest

from router.openai_api import ApiError, ParsedRequest, ResponseShape, parse_request
from router.output import FinalInfo
from router.validation import RequestValidationError, ValidationLimits, validate

LIMITS = ValidationLimits(max_context_tokens=64, vocab_size=1000)


def _parse(chat: bool = False, **fields) -> ParsedRequest:
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {})}
    if not chat:
        body["prompt"] = [5, 6, 7]
    return parse_request({**body, **fields}, chat, "m", "req")


def _validated(**fields):
    return validate(_parse(**fields).request, None, LIMITS)


def test_penalties_reach_the_sampling_params():
    params = _validated(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        logit_bias={"7": -100, "3": 2.5},
        min_tokens=4,
        min_p=0.05,
        max_tokens=10,
    ).params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.1, 0.05, 4)
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    assert params.prompt_tokens == 3  # output counted from here after a migration
    assert params.processes_logits
    assert not _validated(min_p=0.1).params.processes_logits  # min_p works in the sampler alone


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens (10)"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"5000": 1}}, "logit_bias", "outside the vocabulary [0, 1000)"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": [1]}, "logit_bias", "object"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"presence_penalty": "0.5"}, "presence_penalty", "a finite number"),
    ],
)
def test_out_of_range_options_are_400s_naming_field_and_limit(fields, param, words):
    with pytest.raises((ApiError, RequestValidationError)) as error:
        _validated(**fields)
    field = getattr(error.value, "param", None) or error.value.field
    assert field.removeprefix("sampling.") == param and words in str(error.value)


def test_min_tokens_is_cut_with_max_tokens_to_the_context():
    params = _validated(max_tokens=500, min_tokens=200).params
    assert params.max_tokens == params.min_tokens == 64 - 3


def test_a_batch_of_prompts_is_one_request_per_prompt():
    parsed = _parse(prompt=["a", [1, 2], "b"], n=2)
    assert [r.WhichOneof("prompt") for r in parsed.requests] == ["text", "token_ids", "text"]
    assert parsed.requests[1].token_ids.ids == [1, 2]
    assert all(r.sampling == parsed.request.sampling for r in parsed.requests)
    assert _parse(prompt=[[1, 2]]).batch == ()  # a batch of one
    with pytest.raises(ApiError, match=r"prompt\[1\]"):
        _parse(prompt=["a", [1, "x"]])
    with pytest.raises(ApiError, match="at most 256"):
        _parse(prompt=["a"] * 257)


def test_usage_counts_each_prompt_once_and_continuous_usage_every_chunk():
    parsed = _parse(
        prompt=["a", "b"],
        n=2,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    assert parsed.continuous_usage
    shape = ResponseShape(parsed, "m", "req", None, [[1, 2, 3], [4, 5]], ["", ""])
    finals = [FinalInfo("length", p, 2, 0, 0, 0, 0, 0, 0, 0, 0) for p in (3, 3, 2, 2)]
    assert shape.usage_chunk(finals)["usage"]["prompt_tokens"] == 5
    assert shape.usage_chunk(finals)["usage"]["completion_tokens"] == 8
    assert not _parse(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
