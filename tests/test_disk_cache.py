"""The disk cache of GGUF metadata and dequantized weights: used when fresh, never when stale or broken."""

import logging
import os

import pytest
import torch

from engine import disk_cache, gguf_loader
from engine.tokenizer import load_tokenizer
from engine.weights import load_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def parses(monkeypatch):
    """Counts how often the GGUF file itself is opened."""
    calls = []
    real = gguf_loader.open_gguf

    def counting(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(gguf_loader, "open_gguf", counting)
    return calls


def _state(loaded):
    return {name: t.clone() for name, t in loaded.model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_second_load_reads_the_cache_and_gives_the_same_model(cache, parses, default_gguf, dtype):
    first = load_model(str(default_gguf), dtype)
    assert len(parses) == 2  # metadata, then weights
    assert sorted(p.name.rsplit("-", 1)[0] for p in cache.iterdir()) == [
        f"{default_gguf.stem}.metadata", f"{default_gguf.stem}.weights-{str(dtype).removeprefix('torch.')}"]
    second = load_model(str(default_gguf), dtype)
    assert len(parses) == 2  # the file was not opened again
    assert second.config == first.config
    a, b = _state(first), _state(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = "The KV cache moves between workers."
    assert load_tokenizer(str(default_gguf)).encode(prompt) == first.tokenizer.encode(prompt)
    assert len(parses) == 2


def test_a_changed_model_file_is_parsed_again(cache, parses, default_gguf, tmp_path):
    copy = tmp_path / default_gguf.name
    copy.write_bytes(default_gguf.read_bytes())
    load_tokenizer(str(copy))
    load_tokenizer(str(copy))
    assert len(parses) == 1
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load_tokenizer(str(copy))
    assert len(parses) == 2
    assert len(list(cache.iterdir())) == 2  # one entry per version of the file


def test_a_broken_entry_is_logged_and_replaced(cache, parses, default_gguf, caplog):
    expected = load_model(str(default_gguf), torch.bfloat16)
    for entry in cache.iterdir():
        entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="engine.disk_cache"):
        again = load_model(str(default_gguf), torch.bfloat16)
    assert "unreadable metadata cache" in caplog.text and "unreadable weights cache" in caplog.text
    assert len(parses) == 4
    a, b = _state(expected), _state(again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    load_model(str(default_gguf), torch.bfloat16)
    assert len(parses) == 4  # the rewritten entries are good


def test_weights_stay_out_of_the_cache_when_turned_off(cache, default_gguf, monkeypatch):
    monkeypatch.setenv(disk_cache.WEIGHTS_ENV, "0")
    load_model(str(default_gguf), torch.bfloat16)
    assert [p.name.rsplit("-", 1)[0] for p in cache.iterdir()] == [f"{default_gguf.stem}.metadata"]
