"""Tokenizer and chat template, built on the `tokenizers` library. No torch: the router imports
this.

Two sources:
- a GGUF file's metadata (vocabulary, merges, token types, special ids, chat template), rebuilt into
  a byte-level BPE `tokenizers.Tokenizer` the way HF transformers rebuilds it, so both agree token
  for token;
- a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`).

Chat templates are rendered with jinja2 in a sandbox configured like HF's `apply_chat_template`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are added
# text.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer splits by `tokenizer.ggml.pre`, the same table HF transformers uses for GGUF files.
# Anything not listed uses byte-level BPE's GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


class TokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class SpecialTokens:
    bos_token: Optional[str]
    eos_token: Optional[str]
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    unk_token: Optional[str] = None
    pad_token: Optional[str] = None

    @property
    def template_variables(self) -> dict[str, str]:
        """What a chat template sees of these, as HF passes its `special_tokens_map`: only the
        tokens that are set."""
        named = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {name: token for name, token in named.items() if token is not None}


class Tokenizer:
    def __init__(self, backend: HFTokenizer, special: SpecialTokens, chat_template: Optional[str]):
        self.backend = backend
        self.special = special
        self.chat_template = chat_template
        self._compiled_template: Optional[jinja2.Template] = None

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """From GGUF metadata already read into plain Python values (see `engine.gguf_loader`)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        token_types: Sequence[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        alphabet = set(_BYTE_TO_CHAR.values())
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            # a token stored as plain text: respell it in the byte alphabet
            if not set(token) <= alphabet:
                token = "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))
            vocab[token] = index  # a token spelled twice keeps its last id, as HF's rebuild does
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False))
        split = _PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre", ""))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        control = [
            t
            for t, kind in zip(tokens, token_types)
            if kind == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
        ]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user_defined = [
            t
            for t, kind in zip(tokens, token_types)
            if kind == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

        def token_at(key: str) -> Optional[str]:
            token_id = fields.get(key)
            return (
                tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
            )

        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        eot_id = fields.get("tokenizer.ggml.eot_token_id")
        special = SpecialTokens(
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in (eos_id, eot_id) if i is not None)),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            unk_token=token_at("tokenizer.ggml.unknown_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
        )
        return cls(backend, special, fields.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: Path, generation_eos_ids: Sequence[int] = ()) -> "Tokenizer":
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def token_text(value: Any) -> Optional[str]:
            return value.get("content") if isinstance(value, dict) else value

        bos, eos = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
        eos_ids = (
            [backend.token_to_id(eos)]
            if eos is not None and backend.token_to_id(eos) is not None
            else []
        )
        template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = SpecialTokens(
            bos_token=bos,
            eos_token=eos,
            bos_token_id=backend.token_to_id(bos) if bos else None,
            eos_token_ids=tuple(dict.fromkeys([*eos_ids, *generation_eos_ids])),
            add_bos_token=bool(config.get("add_bos_token", False)),
            unk_token=token_text(config.get("unk_token")),
            pad_token=token_text(config.get("pad_token")),
        )
        # A tokenizer.json may carry its own BOS post-processor; then we must not add another.
        if special.add_bos_token and backend.encode("a").ids[:1] == [special.bos_token_id]:
            special = replace(special, add_bos_token=False)
        return cls(backend, special, template)

    # -- use ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.special.add_bos_token
            and self.special.bos_token_id is not None
        ):
            ids = [self.special.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.backend.id_to_token(token_id)

    def use_chat_template(self, template: str) -> None:
        """Replaces the model's chat template (`serve --chat-template`); TokenizerError if it does
        not compile."""
        self._compiled_template = compile_chat_template(template)
        self.chat_template = template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _chat_environment().from_string(self.chat_template)
        # As HF does: keys set to None are dropped (OpenAI clients send `"content": null`, and
        # templates test for a missing key), and `tools`/`documents` are None unless given, which
        # templates test with `is not none`.
        messages = [
            {key: value for key, value in message.items() if value is not None}
            for message in messages
        ]
        variables = {**self.special.template_variables, "tools": None, "documents": None, **extra}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> list[int]:
        """`tools`: the template's `tools` variable (OpenAI's tool definitions), None without
        tools."""
        # The template writes BOS itself where the model wants it, so no special tokens are added.
        extra = {} if tools is None else {"tools": tools}
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **extra),
            add_special_tokens=False,
        )


def _build_byte_table() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shift)
            shift += 1
    return table


_BYTE_TO_CHAR = _build_byte_table()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant tokens with it for training; it
    renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    # The same settings HF's apply_chat_template uses, so templates render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = (
        lambda value, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
            value,
            indent=indent,
            ensure_ascii=ensure_ascii,
            separators=separators,
            sort_keys=sort_keys,
        )
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled as `apply_chat_template` renders it; TokenizerError if it does
    not."""
    try:
        return _chat_environment().from_string(template)
    except jinja2.TemplateError as error:
        raise TokenizerError(f"the chat template does not compile: {error}") from None


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of a model spec (`default`, a .gguf file or an HF directory), without torch."""
    from engine.default_model import resolve_model_path

    path = resolve_model_path(spec)
    if path.is_dir():
        from engine.hf_loader import read_generation_eos

        return Tokenizer.from_hf_dir(path, read_generation_eos(path))
    from engine import gguf_loader

    return Tokenizer.from_gguf_fields(gguf_loader.read_metadata(path)[0])
