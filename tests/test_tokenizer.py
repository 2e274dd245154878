"""The tokenizer and chat template against HF transformers, which rebuilds the same GGUF
metadata."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import types

import pytest

from engine import gguf_loader
from engine.default_model import default_model_path
from engine.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'll we've they'RE",
    "  leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    " " * 17,
    "\n",
    "\n\n\nthree newlines\n\n",
    "\r\nwindows\r\nlines\r\n",
    "   \n   \n\t\n",
    "def f(x):\n    if x:\n        return x  # indented\n\treturn None\n",
    "\t\ttabs\tand\t\tmore\ttabs",
    "class A:\n\tpass\n\n\n    \n",
    "0 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000",
    "日本語のテキストです。",
    "中文测试，包括标点符号！",
    "한국어 텍스트",
    "😀👍🏽👨\u200d👩\u200d👧 🇫🇷 emoji",
    "café naïve résumé Ωμέγα Ärger Straße",
    "e\u0301 combining accent, decomposed",
    "مرحبا بالعالم",
    "שלום עולם, mixed with English",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<repo_name>pdserve<file_sep>engine/tokenizer.py",
    "<|im_start| not quite a special token |im_end|>",
    "Ġ Ċ ĉ are byte-alphabet characters",
    "\x00\x01\x7f control bytes \u00ad soft hyphen \ufeff BOM",
    "a\ufffdb replacement character",
    "(hello) [world] {x/y} a.b.c",
]
TEXT_IDS = [f"text{i}" for i in range(len(TEXTS))]

CONVERSATIONS = {
    "single-user": [{"role": "user", "content": "What is 2+2?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write 日本語 and an emoji 😀\n\twith a tab."},
    ],
    "system-multi-turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Good night"},
        {"role": "assistant", "content": "Bonne nuit"},
    ],
}

# Exercises what the renderer, not the default model's template, must do as HF does:
# `tools`/`documents` are None when absent, keys whose value is None are dropped, the special tokens
# are variables, `tojson` keeps non-ASCII, `{% generation %}` renders its body, and loop controls
# and namespaces work.
RICH_TEMPLATE = (
    "{% set ns = namespace(turns=0) %}"
    "{% if tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% if documents is none %}no documents\n{% endif %}"
    "[{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}]\n"
    "{% for message in messages %}"
    "{% if message.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "{{ message.role }}:"
    "{% if 'content' in message %}"
    "{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}"
    "{% else %}{{ message.content }}{% endif %}"
    "{% else %}<no content>{% endif %}"
    "{% if message.tool_calls is defined %} calls={{ message.tool_calls | tojson }}{% endif %}\n"
    "{% endfor %}"
    "turns={{ ns.turns }}"
    "{% if add_generation_prompt %}\nassistant:{% endif %}"
)
RICH_CONVERSATION = [
    {"role": "user", "content": "Wetter in Zürich?"},
    {"role": "skip", "content": "not rendered"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"name": "weather", "arguments": {"city": "Zürich"}}],
    },
    {"role": "assistant", "content": "Es ist sonnig ☀"},
]


@pytest.fixture(scope="module")
def gguf_fields():
    return gguf_loader.read_fields(gguf_loader.open_gguf(default_model_path()))


@pytest.fixture(scope="module")
def tokenizer(gguf_fields):
    return Tokenizer.from_gguf_fields(gguf_fields)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tests.hf_reference import hf_tokenizer

    return hf_tokenizer(default_model_path())


# -- encode / decode ---------------------------------------------------------------------------


def test_vocabulary_matches_hf(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert tokenizer.backend.get_vocab(with_added_tokens=True) == hf_tokenizer.get_vocab()


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_encode_matches_hf(tokenizer, hf_tokenizer, text, add_special_tokens):
    assert tokenizer.encode(text, add_special_tokens) == hf_tokenizer.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("text", TEXTS, ids=TEXT_IDS)
def test_decode_round_trips_and_matches_hf(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_special_token_strings_are_single_tokens(tokenizer):
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, *tokenizer.encode("user"), 2]
    assert tokenizer.decode([1, *tokenizer.encode("user"), 2], skip_special_tokens=True) == "user"


def test_decode_of_every_control_token_matches_hf(tokenizer, hf_tokenizer, gguf_fields):
    control_ids = [
        i for i, kind in enumerate(gguf_fields["tokenizer.ggml.token_type"]) if kind == 3
    ]
    assert len(control_ids) == 17
    ids = [*tokenizer.encode("before "), *control_ids, *tokenizer.encode(" after")]
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert tokenizer.decode(ids, skip_special_tokens=True) == "before  after"


def test_special_tokens_match_hf(tokenizer, hf_tokenizer):
    special = tokenizer.special
    assert (special.bos_token, special.eos_token) == (
        hf_tokenizer.bos_token,
        hf_tokenizer.eos_token,
    )
    assert (special.unk_token, special.pad_token) == (
        hf_tokenizer.unk_token,
        hf_tokenizer.pad_token,
    )
    assert special.bos_token_id == hf_tokenizer.bos_token_id
    assert special.eos_token_ids == (hf_tokenizer.eos_token_id,)
    assert special.add_bos_token is False


# HF's GGUF rebuild picks the text split by `tokenizer.ggml.pre`; ours must pick the same for every
# name.
PRE_TOKENIZER_TEXT = "(Hello) WORLDs don'T 12345 x/y\n\n  naïve Ünïcode e\u0301 日本語 a\r\n\tb  "


@pytest.mark.parametrize(
    "pre", ["llama-bpe", "falcon3", "deepseek-r1-qwen", "qwen2", "qwen35", "tekken", "gpt-4o"]
)
def test_pre_tokenizer_split_matches_hf(gguf_fields, hf_tokenizer, pre):
    # An internal of HF's GGUF support (transformers 5), so it may move; the rest of the file does
    # not need it.
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    # HF's own function, applied to a stand-in backend, says which split it would use for this name.
    hf_backend = types.SimpleNamespace(pre_tokenizer=hf_tokenizer.backend_tokenizer.pre_tokenizer)
    mapping.set_split_regex(
        types.SimpleNamespace(backend_tokenizer=hf_backend), {"pre_tokenizer_type": pre}
    )
    assert hf_backend.pre_tokenizer is not hf_tokenizer.backend_tokenizer.pre_tokenizer, (
        f"HF has no split for {pre}"
    )
    ours = Tokenizer.from_gguf_fields(
        {**gguf_fields, "tokenizer.ggml.pre": pre}
    ).backend.pre_tokenizer
    expected = hf_backend.pre_tokenizer.pre_tokenize_str(PRE_TOKENIZER_TEXT)
    assert ours.pre_tokenize_str(PRE_TOKENIZER_TEXT) == expected


def test_token_spelled_twice_keeps_its_last_id():
    # "ab" appears at ids 3 and 4; HF's rebuild maps the text to the later id, so must we.
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "ab"],
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
    }
    assert Tokenizer.from_gguf_fields(fields).encode("abc") == [4, 2]


# -- chat template -----------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_matches_hf(tokenizer, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        == expected
    )
    assert tokenizer.encode_chat(messages, add_generation_prompt) == hf_tokenizer.encode(
        expected, add_special_tokens=False
    )


def test_chat_template_shape(tokenizer):
    # The default template adds a system turn when there is none, and the generation prompt only
    # when asked.
    with_prompt = tokenizer.apply_chat_template(
        CONVERSATIONS["single-user"], add_generation_prompt=True
    )
    without = tokenizer.apply_chat_template(
        CONVERSATIONS["single-user"], add_generation_prompt=False
    )
    assert with_prompt.startswith("<|im_start|>system\n")
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert without.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n")


@pytest.mark.parametrize("with_tools", [False, True])
def test_template_features_render_as_in_hf(tokenizer, hf_tokenizer, with_tools):
    rich = Tokenizer(tokenizer.backend, tokenizer.special, RICH_TEMPLATE)
    extra = (
        {"tools": [{"name": "weather", "description": "Wetter für eine Stadt"}]}
        if with_tools
        else {}
    )
    expected = hf_tokenizer.apply_chat_template(
        RICH_CONVERSATION,
        chat_template=RICH_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        **extra,
    )
    rendered = rich.apply_chat_template(RICH_CONVERSATION, add_generation_prompt=True, **extra)
    assert rendered == expected
    assert "Zürich" in rendered and "turns=3" in rendered and ("TOOLS" in rendered) == with_tools


def test_a_replacement_chat_template_is_used_and_a_broken_one_refused(gguf_fields):
    tokenizer = Tokenizer.from_gguf_fields(gguf_fields)  # its own: the fixture's is shared
    tokenizer.use_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    text = "<user>hi"
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == tokenizer.encode(
        text, add_special_tokens=False
    )
    with pytest.raises(TokenizerError, match="does not compile"):
        tokenizer.use_chat_template("{% for m in messages %}")
