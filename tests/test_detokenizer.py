"""Streaming detokenization: token by token it must add up to the full decode, and stop strings cut
it."""

import pytest

from engine import gguf_loader
from engine.default_model import default_model_path
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

STREAM_TEXTS = [
    "Hello, world! How are you today?",
    " leading space and trailing space ",
    "def f(x):\n    if x:\n\t\treturn x  # tab\n\n\n",
    "   runs   of   spaces\n\n\nand newlines\r\n",
    "0 12 345 6789 3.14159",
    "日本語のテキストです。中文测试，标点！한국어",
    "😀👍🏽👨\u200d👩\u200d👧 🇫🇷 emoji then text",
    "café naïve résumé Ωμέγα e\u0301",
    "مرحبا بالعالم שלום עולם",
    "Ġ Ċ ĉ \x00\x7f \u00ad\ufeff",
    "<|im_start|>assistant\nspecial tokens are skipped<|im_end|>\n",
    "a\ufffdb keeps its own replacement character",
]
TEXT_IDS = [f"text{i}" for i in range(len(STREAM_TEXTS))]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf_fields(
        gguf_loader.read_fields(gguf_loader.open_gguf(default_model_path()))
    )


@pytest.fixture(scope="module")
def chat_prompt(tokenizer):
    return tokenizer.encode_chat([{"role": "user", "content": "Say something."}])


def _stream(detok, token_ids):
    """The chunks `add_token` returns, then the one `flush` returns."""
    return [detok.add_token(t) for t in token_ids], detok.flush()


def _output_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


# -- streaming ---------------------------------------------------------------------------------


def test_sample_splits_characters_across_tokens(tokenizer):
    # Without tokens that end inside a UTF-8 character, the streaming tests below would prove
    # nothing.
    ids = _output_ids(tokenizer, "😀日本語")
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("prompt_kind", ["chat", "empty"])
@pytest.mark.parametrize("text", STREAM_TEXTS, ids=TEXT_IDS)
def test_stream_adds_up_to_full_decode(tokenizer, chat_prompt, text, prompt_kind):
    prompt = chat_prompt if prompt_kind == "chat" else []
    ids = _output_ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    chunks, tail = _stream(detok, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) + tail == expected
    assert detok.text == expected
    assert detok.stop_string is None
    if "\ufffd" not in text:
        assert not any("\ufffd" in chunk for chunk in chunks)


def test_without_stop_strings_nothing_is_held_back(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "plain words, nothing special")
    chunks, tail = _stream(IncrementalDetokenizer(tokenizer, chat_prompt), ids)
    assert all(chunks) and tail == ""


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    (first,) = _output_ids(tokenizer, " world")
    assert IncrementalDetokenizer(tokenizer, prompt).add_token(first) == " world"


def test_output_ending_inside_a_character_flushes_it_as_replacement(tokenizer, chat_prompt):
    # generation stopped (max_tokens) in the middle of the emoji
    ids = _output_ids(tokenizer, "ab😀")[:-1]
    detok = IncrementalDetokenizer(tokenizer, chat_prompt)
    chunks, tail = _stream(detok, ids)
    assert "".join(chunks) == "ab"
    assert tail == "\ufffd" and detok.text == tokenizer.decode(ids) == "ab\ufffd"
    assert detok.flush() == ""


# -- stop strings ------------------------------------------------------------------------------


def _stream_until_stop(detok, token_ids):
    chunks = []
    for count, token_id in enumerate(token_ids, start=1):
        chunks.append(detok.add_token(token_id))
        if detok.stop_string is not None:
            return chunks, count
    return chunks, len(token_ids)


def test_stop_string_cuts_text_before_it(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "The answer is 42. END of the answer, and more text after it.")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["END"])
    chunks, used = _stream_until_stop(detok, ids)
    assert detok.stop_string == "END"
    assert used < len(ids)
    assert "".join(chunks) == detok.text == "The answer is 42. "
    # The sequence is finished: later tokens and the flush add nothing.
    assert [detok.add_token(t) for t in ids[used:]] == [""] * (len(ids) - used)
    assert detok.flush() == "" and detok.text == "The answer is 42. "


def test_stop_string_spanning_tokens_is_found(tokenizer, chat_prompt):
    text, stop = "Hello world, and goodbye.", "lo wor"
    ids = _output_ids(tokenizer, text)
    # it only exists across a token boundary
    assert not any(stop in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=[stop])
    chunks, _ = _stream_until_stop(detok, ids)
    assert detok.stop_string == stop
    assert "".join(chunks) + detok.flush() == "Hel"


def test_stop_string_inside_one_token(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "Hello there")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["ell"])
    assert detok.add_token(ids[0]) == "H"
    assert detok.stop_string == "ell"


def test_stop_string_of_split_characters(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "ok 😀 then 日本")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["😀 t"])
    chunks, _ = _stream_until_stop(detok, ids)
    assert detok.stop_string == "😀 t"
    assert "".join(chunks) + detok.flush() == "ok "
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_earliest_stop_string_wins(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "one two three four")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["four", "two", "three"])
    chunks, _ = _stream_until_stop(detok, ids)
    assert detok.stop_string == "two"
    assert "".join(chunks) + detok.flush() == "one "


def test_partial_stop_string_is_held_back_then_flushed(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "Hello wor")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["world"])
    chunks, tail = _stream(detok, ids)
    # "wor" could still become "world", so it waits; the rest streams at once.
    assert "".join(chunks) == "Hello "
    assert detok.stop_string is None
    assert tail == "wor" and detok.text == "Hello wor"


def test_text_that_cannot_start_a_stop_string_streams_at_once(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "Hello there, friend")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["###", "\n\nUser:"])
    chunks, tail = _stream(detok, ids)
    assert chunks == [tokenizer.decode([t]) for t in ids]
    assert tail == ""


def test_held_back_text_streams_once_the_match_fails(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "x ## y")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=["###"])
    chunks, tail = _stream(detok, ids)
    assert "".join(chunks) + tail == "x ## y"
    assert tail == "" and detok.stop_string is None


def test_empty_stop_string_is_ignored(tokenizer, chat_prompt):
    ids = _output_ids(tokenizer, "some text")
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, stop=[""])
    chunks, tail = _stream(detok, ids)
    assert "".join(chunks) + tail == "some text" and detok.stop_string is None
