"""Penalties, biases, min_tokens and min_p: the batched code (engine/penalties.py, sampling.py)
against a reference written plainly, one row and one token at a time; then through the engine."""

import dataclasses

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine, RequestError
from engine.penalties import apply_penalties
from engine.sampling import SamplingParams, sample
from engine.sequence import Sequence
from engine.weights import load_model

VOCAB = 64
EOS = (2,)


def _reference(logits: torch.Tensor, seq: Sequence, eos=EOS) -> torch.Tensor:
    """One row, as the definitions read: bias, min_tokens, repetition, frequency, presence."""
    p = seq.params
    x = logits.clone()
    for token_id, bias in p.logit_bias:
        x[token_id] += bias
    if len(seq.output_token_ids) < p.min_tokens:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
        masked = x.clone()
        for token_id in stops:
            masked[token_id] = float("-inf")
        if torch.isfinite(masked).any():
            x = masked
    for token_id in set(seq.prompt_token_ids + seq.output_token_ids):
        if p.repetition_penalty != 1.0:
            value = x[token_id]
            x[token_id] = (
                value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            )
    output = seq.prompt_token_ids[p.prompt_tokens :] if p.prompt_tokens else []
    output = output + seq.output_token_ids
    for token_id in set(output):
        count = output.count(token_id)
        x[token_id] -= p.frequency_penalty * count + p.presence_penalty
    return x


def _seq(prompt, output, **params) -> Sequence:
    return Sequence("r", list(prompt), SamplingParams(**params), output_token_ids=list(output))


def _batch():
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [
        _seq(prompt(7), prompt(5), presence_penalty=0.5, frequency_penalty=0.7),
        _seq(prompt(3), [], temperature=0),  # nothing asked: untouched
        _seq(prompt(9), prompt(12), repetition_penalty=1.3),
        _seq(prompt(4), prompt(2), logit_bias=((5, 100.0), (6, -100.0), (7, 2.5))),
        _seq(prompt(6), prompt(1), min_tokens=4, stop_token_ids=(9,)),
        _seq(prompt(6), prompt(1), min_tokens=4, ignore_eos=True, stop_token_ids=(9,)),
        _seq(
            prompt(8),
            prompt(6),
            presence_penalty=-1.0,
            frequency_penalty=2.0,
            repetition_penalty=0.8,
            logit_bias=((3, -3.0),),
            min_tokens=20,
            max_tokens=30,
        ),
        # a migrated request: its prompt's last 5 tokens were output, and count as such
        _seq(prompt(10), prompt(3), frequency_penalty=1.0, prompt_tokens=5),
    ]


def test_batched_penalties_equal_the_plain_reference_row_by_row():
    seqs = _batch()
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    got = apply_penalties(logits, seqs, EOS)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(got[row], _reference(logits[row], seq), rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1])
    assert got[3].argmax() == 5 and got[3, 6] < logits[3].min()
    assert got[4, 2] == got[4, 9] == float("-inf") and got[5, 2] > float("-inf")


def test_a_batch_asking_for_nothing_is_returned_as_it_is():
    seqs = [_seq([3, 4], [5]), _seq([6], [], temperature=0)]
    logits = torch.randn(2, VOCAB)
    assert apply_penalties(logits, seqs, EOS) is logits
    assert not any(s.params.processes_logits for s in seqs)


def test_min_tokens_keeps_eos_where_nothing_else_is_allowed():
    seq = _seq([3, 4], [], min_tokens=3)
    seq.matcher = object()  # a grammar's row (only those can be left with nothing)
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, EOS[0]] = 1.0  # a grammar that lets only EOS follow
    assert apply_penalties(logits, [seq], EOS)[0, EOS[0]] == 1.0


def test_penalties_change_what_greedy_picks():
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 2.0, 1.5
    fresh = _seq([3], [], temperature=0, presence_penalty=1.0)
    repeated = _seq([3], [10], temperature=0, presence_penalty=1.0)
    assert sample(apply_penalties(logits, [fresh], EOS), [fresh.params], [1]) == [10]
    assert sample(apply_penalties(logits, [repeated], EOS), [repeated.params], [2]) == [11]


def _min_p_reference(logits, params, position):
    """Temperature, then min_p, then the inverse-CDF draw the sampler makes."""
    scaled = logits / params.temperature
    probs = scaled.softmax(-1)
    keep = probs >= params.min_p * probs.max()
    scaled = torch.where(keep, scaled, torch.tensor(float("-inf")))
    generator = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % 2**63)
    cdf = scaled.softmax(-1).cumsum(-1)
    draw = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, draw, right=True)), VOCAB - 1)


def test_min_p_drops_the_unlikely_tokens_and_matches_the_reference():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=1.5, min_p=0.3, seed=7)
    probs = (logits / 1.5).softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < VOCAB
    drawn = set()
    for position in range(200):
        token = sample(logits.unsqueeze(0), [params], [position])[0]
        assert token == _min_p_reference(logits, params, position)
        drawn.add(token)
    assert drawn <= allowed and len(drawn) > 1
    unrestricted = dataclasses.replace(params, min_p=0.0)
    assert any(
        sample(logits.unsqueeze(0), [unrestricted], [i])[0] not in allowed for i in range(200)
    )


@pytest.mark.parametrize(
    "field, value, limit",
    [
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("min_p", 1.5, "[0, 1]"),
        ("min_tokens", 17, "max_tokens (16)"),
        ("logit_bias", ((3, 101.0),), "[-100, 100]"),
        ("logit_bias", ((-1, 1.0),), ">= 0"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field_and_limit(field, value, limit):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value).startswith(field) and limit in str(error.value)


@pytest.fixture(scope="module")
def tiny():
    return load_model("dummy:tiny", torch.float32)


def _engine(tiny):
    return LLMEngine(EngineConfig(model="dummy:tiny", block_size_tokens=8), loaded=tiny)


def test_the_engine_applies_them_where_each_token_is_sampled(tiny):
    engine = _engine(tiny)
    prompt = list(range(3, 20))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = engine.generate([prompt], greedy)[0].token_ids
    banned = plain[0]
    biased = dataclasses.replace(greedy, logit_bias=((banned, -100.0),))
    assert banned not in engine.generate([prompt], biased)[0].token_ids
    forced = dataclasses.replace(greedy, logit_bias=((7, 100.0),))
    assert engine.generate([prompt], forced)[0].token_ids == [7] * 12
    # frequency: no token greedily repeated forever
    penalized = dataclasses.replace(greedy, frequency_penalty=2.0, presence_penalty=2.0)
    tokens = engine.generate([prompt], penalized)[0].token_ids
    assert tokens != plain and len(set(tokens)) > len(tokens) // 2


def test_min_tokens_holds_a_stop_token_back_in_the_engine(tiny):
    engine = _engine(tiny)
    prompt = list(range(3, 20))
    greedy = SamplingParams(max_tokens=8, temperature=0)
    first = engine.generate([prompt], greedy)[0].token_ids[0]
    stopped = dataclasses.replace(greedy, stop_token_ids=(first,))
    assert engine.generate([prompt], stopped)[0].token_ids == [first]
    held = dataclasses.replace(stopped, min_tokens=5)
    tokens = engine.generate([prompt], held)[0].token_ids
    assert len(tokens) >= 5 and first not in tokens[:4]


def test_a_migrated_request_continues_with_the_same_penalties(tiny):
    """Re-prefilled as prompt + tokens sent, with prompt_tokens marking where output begins (and
    max_tokens, min_tokens cut as the router cuts them), it samples what one run samples."""
    engine = _engine(tiny)
    prompt = list(range(3, 20))
    params = SamplingParams(
        max_tokens=12,
        temperature=0.8,
        seed=5,
        ignore_eos=True,
        frequency_penalty=1.2,
        presence_penalty=0.4,
        repetition_penalty=1.2,
        prompt_tokens=len(prompt),
    )
    whole = engine.generate([prompt], params)[0].token_ids
    sent = whole[:5]
    resumed = dataclasses.replace(params, max_tokens=7)
    assert engine.generate([prompt + sent], resumed)[0].token_ids == whole[5:]
    # without prompt_tokens the sent tokens would not count as output: a different stream
    forgot = dataclasses.replace(resumed, prompt_tokens=None)
    assert engine.generate([prompt + sent], forgot)[0].token_ids != whole[5:]


def test_logit_bias_outside_the_vocabulary_is_refused_by_the_engine(tiny):
    engine = _engine(tiny)
    with pytest.raises(RequestError, match="outside"):
        engine.add_request("x", [3, 4], SamplingParams(logit_bias=((10**6, 1.0),)))
