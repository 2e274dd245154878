"""A per-user disk cache of what is slow to rebuild at every start: a model file's metadata, its
weights (dequantized, or for an fp32 CPU model laid out as it serves: weights.py), transformers'
reading of it (tests/hf_reference.py), and the compiled attention kernel.

Parsing the default GGUF file's metadata takes gguf-py 2 s and dequantizing its weights 1 s, in the
router and in every worker, at every start and every scale-up; from here they load in milliseconds.
An entry is keyed by the source file's content (its sha256, and the entry's kind), so a changed file
is never served from a stale entry and copies of one file share entries: every checkout of this repo
holds the default model in its own `.venv`. Hashing the file is done once per path, size and
modification time and remembered in a small index. Entries are written beside their final name and
renamed into place, so processes starting together never read a half-written one. Anything that goes
wrong with the cache is logged and the slow path runs instead.

The model entries are bounded (`$PDSERVE_CACHE_MAX_GIB`, default 16; `inf` for no bound): each use
marks an entry used, and after each write the least recently used entries go until the rest fit,
never the one just written. An entry a running process has mapped stays readable to it until it
unmaps it (Linux keeps a removed file's pages for their users).

Location: `$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`.
`PDSERVE_WEIGHTS_CACHE=0` keeps weights out of it (they take the model's size in the serving dtype).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import msgpack

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_CACHE_DIR"
WEIGHTS_ENV = "PDSERVE_WEIGHTS_CACHE"
MAX_ENV = "PDSERVE_CACHE_MAX_GIB"
DEFAULT_MAX_GIB = 16.0
FORMAT_VERSION = 2  # bump when what is stored, or how, changes (2: keyed by content)
STALE_PARTIAL_S = 3600  # a write left unfinished this long ago belongs to a process that died


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve"


def write_atomically(target: Path, write: Callable[[str], None]) -> None:
    """Calls `write(temporary_path)` and renames the result to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def directory(source: Path, kind: str, write: Callable[[Path], None]) -> Path:
    """The `kind` entry for `source` that is a directory, filled by `write(folder)` when missing:
    written beside its final name and renamed into place, whole or not at all. Where it cannot be
    cached, the folder `write` filled outside the cache (logged)."""
    entry = entry_path(source, kind, "")
    if entry.is_dir():
        mark_used(entry)
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(
            tempfile.mkdtemp(prefix=entry.name + ".", suffix=".partial", dir=entry.parent)
        )
    except OSError as error:
        log.warning("could not cache the %s of %s: %s", kind, source, error)
        partial = Path(tempfile.mkdtemp(prefix="pdserve-"))
        write(partial)
        return partial
    try:
        write(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        os.rename(partial, entry)
    except OSError as error:
        if not entry.is_dir():
            log.warning("could not cache the %s of %s: %s", kind, source, error)
            return partial
        # a process writing it at the same time got there first
        shutil.rmtree(partial, ignore_errors=True)
    prune(keep=entry)
    return entry


def entry_path(source: Path, kind: str, suffix: str) -> Path:
    """Where the `kind` entry for `source` lives (keyed by its content)."""
    key = hashlib.sha256(f"{content_digest(source)}\0{FORMAT_VERSION}\0{kind}".encode())
    return cache_root() / "models" / f"{source.stem}.{kind}-{key.hexdigest()[:16]}{suffix}"


_digests: dict[str, str] = {}  # this process's memo of the index


def content_digest(source: Path) -> str:
    """The sha256 of `source`'s bytes, read from the index when this path, size and modification
    time were hashed before (0.12 s for the default model's 98 MB, seconds for a large model)."""
    stat = source.stat()
    identity = hashlib.sha256(
        f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    ).hexdigest()[:32]
    if identity in _digests:
        return _digests[identity]
    index = cache_root() / "index" / identity
    try:
        digest = index.read_text()
    except OSError:
        digest = ""
    if len(digest) != 64:
        with open(source, "rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
        try:
            write_atomically(index, lambda path: Path(path).write_text(digest))
        except OSError as error:
            log.warning("could not remember the digest of %s: %s", source, error)
    _digests[identity] = digest
    return digest


def mark_used(entry: Path) -> None:
    """Records a use of `entry` (its modification time), which keeps it from being pruned first."""
    try:
        os.utime(entry)
    except OSError:
        pass  # read-only or just pruned: it only orders pruning


def prune(keep: Path) -> None:
    """Removes the least recently used model entries, never `keep`, until the rest fit in the bound;
    and writes that processes which died left unfinished. Failures are logged."""
    try:
        bound = float(os.environ.get(MAX_ENV) or DEFAULT_MAX_GIB) * 2**30
    except ValueError:
        log.warning(
            "%s=%r is not a number of GiB; using %s", MAX_ENV, os.environ[MAX_ENV], DEFAULT_MAX_GIB
        )
        bound = DEFAULT_MAX_GIB * 2**30
    try:
        entries = []
        for path in keep.parent.iterdir():
            try:
                stat = path.stat()
                if path.name.endswith(".partial"):
                    if time.time() - stat.st_mtime > STALE_PARTIAL_S:
                        _remove(path)
                    continue
                entries.append((stat.st_mtime, _size(path, stat), path))
            except FileNotFoundError:
                continue  # another process pruned it meanwhile
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda entry: entry[0]):
            if total <= bound:
                break
            if path != keep:
                _remove(path)
                total -= size
                log.info(
                    "pruned %s from the disk cache (%.0f MiB; bound %s=%g GiB)",
                    path.name,
                    size / 2**20,
                    MAX_ENV,
                    bound / 2**30,
                )
    except OSError as error:
        log.warning("could not prune the disk cache in %s: %s", keep.parent, error)


def _size(path: Path, stat: os.stat_result) -> int:
    if not path.is_dir():
        return stat.st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def gguf_metadata(source: Path, parse: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The file's metadata, as `parse()` returns it (plain msgpack-able values), from the cache if
    there."""
    entry = entry_path(source, "metadata", ".msgpack")
    try:
        metadata = msgpack.unpackb(entry.read_bytes(), raw=False, strict_map_key=False)
        mark_used(entry)
        return metadata
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as error:
        log.warning("unreadable metadata cache %s (%s); parsing the model file", entry, error)
    metadata = parse()
    try:
        packed = msgpack.packb(metadata, use_bin_type=True)
        write_atomically(entry, lambda path: Path(path).write_bytes(packed))
        prune(keep=entry)
    except (OSError, TypeError, ValueError) as error:
        log.warning("could not cache the metadata of %s: %s", source, error)
    return metadata


def gguf_weights(
    source: Path, dtype: "torch.dtype", produce: Callable[[], Iterable[tuple[str, "torch.Tensor"]]]
) -> Iterable[tuple[str, "torch.Tensor"]]:
    """The (name, tensor) pairs `produce()` gives for serving in `dtype`, from the cache if
    there."""
    kind = f"weights-{str(dtype).removeprefix('torch.')}"
    cached = tensors(source, kind)
    if cached is not None:
        return cached.items()
    produced = {name: tensor.contiguous() for name, tensor in produce()}
    save_tensors(source, kind, produced)
    return produced.items()


def tensors(source: Path, kind: str) -> Optional[dict[str, "torch.Tensor"]]:
    """The tensors of the `kind` entry for `source`, memory-mapped: read from the page cache, which
    every process of the machine shares, and only where touched. None when there is none or it is
    unreadable (logged)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if os.environ.get(WEIGHTS_ENV) == "0":
        return None
    entry = entry_path(source, kind, ".safetensors")
    try:
        loaded = load_file(entry)
        mark_used(entry)
        return loaded
    except FileNotFoundError:
        return None
    except (OSError, SafetensorError) as error:
        log.warning("unreadable weights cache %s (%s); reading the model file", entry, error)
        return None


def save_tensors(source: Path, kind: str, named: dict[str, "torch.Tensor"]) -> None:
    """Writes the `kind` entry for `source` (contiguous tensors that share no memory); failures are
    logged."""
    from safetensors.torch import save_file

    if os.environ.get(WEIGHTS_ENV) == "0":
        return
    entry = entry_path(source, kind, ".safetensors")

    def write(path: str) -> None:
        pad = _aligning_pad(named)
        save_file(named, path, metadata={"pad": pad})
        header = _header(path)
        # safetensors laid its header out otherwise: pad what it wrote
        if (8 + len(header)) % _ALIGN_BYTES:
            unpadded = len(header.rstrip()) - len(pad)  # its length with an empty pad
            save_file(named, path, metadata={"pad": " " * ((-8 - unpadded) % _ALIGN_BYTES)})

    try:
        write_atomically(entry, write)
        log.info(
            "cached the %s of %s in %s (%.0f MiB)",
            kind,
            source.name,
            entry,
            entry.stat().st_size / 2**20,
        )
        prune(keep=entry)
    except OSError as error:
        log.warning("could not cache the %s of %s: %s", kind, source, error)


# Tensors are used in place where they are mapped: their data starts on a cache line when the header
# (8 bytes of length, then JSON) ends on one, as every tensor size of a model is a multiple of 64
# bytes.
_ALIGN_BYTES = 64
_SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def _aligning_pad(named: dict[str, "torch.Tensor"]) -> str:
    """The metadata padding that ends the header on a cache line, from the header safetensors writes
    (compact JSON, tensors of one dtype by name), so that one write suffices; `save_tensors`
    checks."""
    entries, offset = {}, 0
    for name in sorted(named):
        tensor = named[name]
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES.get(str(tensor.dtype), "?"),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps({"__metadata__": {"pad": ""}, **entries}, separators=(",", ":"))
    return " " * ((-8 - len(header)) % _ALIGN_BYTES)


def _header(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read(int.from_bytes(file.read(8), "little"))
