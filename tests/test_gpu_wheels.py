"""scripts/gpu_wheels.py's tokenizer-only GGUF: what the device needs to serve the 8B shape (a dummy
model with the default model's tokenizer) in one carried part, 2 MB instead of the model's 98."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from engine.default_model import default_model_path  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from gpu_wheels import _tokenizer_only  # noqa: E402


def test_the_tokenizer_only_gguf_tokenizes_as_the_model_does(tmp_path):
    path = _tokenizer_only(default_model_path(), tmp_path / "tokenizer.gguf")
    assert path.stat().st_size < 4 << 20
    alone, full = load_tokenizer(str(path)), load_tokenizer("default")
    text = "Disaggregated prefill ships the KV cache: 1024 tokens, ünïcode and\ttabs."
    assert alone.encode(text) == full.encode(text)
    chat = [{"role": "user", "content": text}]
    assert alone.encode_chat(chat) == full.encode_chat(chat)
    assert alone.special == full.special
    ids = full.encode(text)
    assert alone.decode(ids) == full.decode(ids) == text
