"""The disk cache of GGUF metadata and dequantized weights: used when fresh, never when stale or
broken."""

import logging
import os

import pytest
import torch

from engine import disk_cache, gguf_loader
from engine.cpu_packing import TransposedLinear, decode_linear_supported, transposing_supported
from engine.tokenizer import load_tokenizer
from engine.weights import load_model, model_over, serving_tensors


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(disk_cache, "_digests", {})  # as in a fresh process
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
    return loaded.model.state_dict()  # no copies: 1.3 GB of fresh memory took 14 s to fault in here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_second_load_reads_the_cache_and_gives_the_same_model(cache, parses, default_gguf, dtype):
    first = load_model(str(default_gguf), dtype)
    assert len(parses) == 2  # metadata, then weights
    assert sorted(p.name.rsplit("-", 1)[0] for p in cache.iterdir()) == [
        f"{default_gguf.stem}.metadata",
        f"{default_gguf.stem}.{_weights_kind(dtype)}",
    ]
    second = load_model(str(default_gguf), dtype)
    assert len(parses) == 2  # the file was not opened again
    assert second.config == first.config
    a, b = _state(first), _state(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = "The KV cache moves between workers."
    assert load_tokenizer(str(default_gguf)).encode(prompt) == first.tokenizer.encode(prompt)
    assert len(parses) == 2
    if _weights_kind(dtype).startswith("serving-"):
        _assert_served_in_place(first, second, next(cache.glob(f"*.{_weights_kind(dtype)}-*")))


def _assert_served_in_place(built, mapped, entry):
    """`mapped`'s linears read the cache entry's pages, with no copy, and compute what `built`'s
    do."""
    ranges = _mapped_ranges(entry)
    layers = [m for m in mapped.model.modules() if isinstance(m, TransposedLinear)]
    assert len(layers) == 1 + 4 * built.config.num_layers  # the tied head and each layer's four
    panels = [m.weight_panels for m in layers if m.weight_panels is not None]
    for tensor in [m.weight_t for m in layers] + panels + [mapped.model.embed_tokens.weight]:
        assert any(start <= tensor.data_ptr() < end for start, end in ranges)
        assert tensor.data_ptr() % 64 == 0  # on a cache line, as the entry was written
    # decode batches through the C kernel where the CPU wants it, on the mapped panels themselves
    assert all((m.decode is not None) == decode_linear_supported() for m in layers)
    generator = torch.Generator().manual_seed(0)
    for ours, theirs in zip(
        [m for m in built.model.modules() if isinstance(m, TransposedLinear)], layers
    ):
        # a decode batch: the kernel where used
        x = torch.randn(5, ours.weight_t.shape[0], generator=generator)
        assert torch.equal(ours(x), theirs(x))


def test_a_model_over_serving_tensors_that_do_not_fit_is_a_value_error_naming_the_tensor():
    built = load_model("dummy:tiny", torch.float32)
    tensors = serving_tensors(built.model)
    over = model_over(built.config, tensors, "cpu")
    ids = torch.tensor([1, 5, 9])
    a, b = built.model.state_dict(), over.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # in place
    assert over.layers[0].mlp.down_proj.weight_t is tensors["layers.0.mlp.down_proj.weight_t"]
    assert torch.equal(over.embed_tokens(ids), built.model.embed_tokens(ids))
    for name, bad in [
        ("layers.0.mlp.down_proj.weight_t", lambda t: t[:-1]),
        ("norm.weight", lambda t: t[:-1]),
        ("layers.1.self_attn.o_proj.weight_t", None),
    ]:
        broken = dict(tensors)
        if bad is None:
            del broken[name]
        else:
            broken[name] = bad(broken[name])
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            model_over(built.config, broken, "cpu")


def _weights_kind(dtype):
    """fp32 on a CPU serves transposed linears (with the decode kernel's panels on AVX2), and those
    are cached as they serve; other layouts are cached as dequantized."""
    name = str(dtype).removeprefix("torch.")
    if not transposing_supported(dtype, "cpu"):
        return f"weights-{name}"
    return f"serving-{name}-transposed" + ("-panels" if decode_linear_supported() else "")


def _mapped_ranges(path):
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_entries_follow_the_file_content_not_its_path(cache, parses, default_gguf, tmp_path):
    """A copy elsewhere (another checkout's model) reads the same entries; a touched file is hashed
    again and still matches; a changed file is parsed again, into an entry of its own."""
    load_tokenizer(str(default_gguf))
    assert len(parses) == 1
    copy = tmp_path / default_gguf.name
    copy.write_bytes(default_gguf.read_bytes())
    load_tokenizer(str(copy))
    assert len(parses) == 1
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    disk_cache._digests.clear()
    load_tokenizer(str(copy))
    assert len(parses) == 1
    # the last byte lies in tensor data, which the metadata does not read
    with open(copy, "r+b") as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 1]))
    load_tokenizer(str(copy))
    assert len(parses) == 2
    assert len(list(cache.iterdir())) == 2  # one entry per content of the file
    # one digest per path, size and time seen
    assert len(list((cache.parent / "index").iterdir())) == 4


def test_the_cache_is_pruned_least_recently_used_first_never_the_entry_just_written(
    cache, tmp_path, monkeypatch
):
    monkeypatch.setenv(disk_cache.MAX_ENV, str(2.5 * 2**20 / 2**30))  # room for two 1 MiB entries
    sources = []
    for name in "abcd":
        sources.append(tmp_path / f"{name}.gguf")
        sources[-1].write_bytes(name.encode())
    one_mib = {"w": torch.zeros(2**18)}

    def write(source):
        disk_cache.save_tensors(source, "weights-float32", one_mib)
        entry = disk_cache.entry_path(source, "weights-float32", ".safetensors")
        os.utime(
            entry, (entry.stat().st_atime, entry.stat().st_mtime - 100 + len(list(cache.iterdir())))
        )
        return entry

    a, b = write(sources[0]), write(sources[1])
    # a is now the one used last
    assert disk_cache.tensors(sources[0], "weights-float32") is not None
    stale = cache / "x.weights-float32-0.safetensors.123.partial"
    stale.write_bytes(b"half")
    os.utime(stale, (0, 0))
    c = write(sources[2])
    assert sorted(cache.iterdir()) == sorted([a, c])  # b went; so did the write a dead process left
    assert not b.exists()
    # a directory entry (tests/hf_reference.py)
    converted = disk_cache.entry_path(sources[1], "hf-transformers", "")
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(bytes(2**20))
    os.utime(converted, (0, 0))  # the least recently used, and with c as large as the bound allows
    disk_cache.prune(keep=c)
    assert sorted(cache.iterdir()) == sorted([a, c])
    monkeypatch.setenv(disk_cache.MAX_ENV, str(0.5 * 2**20 / 2**30))  # less than one entry
    d = write(sources[3])
    assert list(cache.iterdir()) == [d]
    assert torch.equal(disk_cache.tensors(sources[3], "weights-float32")["w"], one_mib["w"])


def test_a_broken_entry_is_logged_and_replaced(cache, parses, default_gguf, caplog):
    dtype = torch.bfloat16  # the fp32 serving entry is read by the same disk_cache.tensors
    expected = load_model(str(default_gguf), dtype)
    for entry in cache.iterdir():
        entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="engine.disk_cache"):
        again = load_model(str(default_gguf), dtype)
    assert "unreadable metadata cache" in caplog.text and "unreadable weights cache" in caplog.text
    assert len(parses) == 4
    a, b = _state(expected), _state(again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    load_model(str(default_gguf), dtype)
    assert len(parses) == 4  # the rewritten entries are good


def test_weights_stay_out_of_the_cache_when_turned_off(cache, default_gguf, monkeypatch):
    monkeypatch.setenv(disk_cache.WEIGHTS_ENV, "0")
    load_model(str(default_gguf), torch.bfloat16)
    assert [p.name.rsplit("-", 1)[0] for p in cache.iterdir()] == [f"{default_gguf.stem}.metadata"]
