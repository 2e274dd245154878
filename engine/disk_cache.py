"""A per-user disk cache of what is slow to rebuild at every start: a model file's metadata, its
dequantized weights, and the compiled attention kernel.

Parsing the default GGUF file's metadata takes gguf-py 2 s and dequantizing its weights 1 s, in the
router and in every worker, at every start and every scale-up; from here they load in milliseconds.
An entry is keyed by the source file's path, size and modification time (and the serving dtype), so
a changed file is never served from a stale entry. Entries are written beside their final name and
renamed into place, so processes starting together never read a half-written one. Anything that goes
wrong with the cache is logged and the slow path runs instead.

Location: `$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`.
`PDSERVE_WEIGHTS_CACHE=0` keeps weights out of it (they take the model's size in the serving dtype).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import msgpack

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CACHE_ENV = "PDSERVE_CACHE_DIR"
WEIGHTS_ENV = "PDSERVE_WEIGHTS_CACHE"
FORMAT_VERSION = 1  # bump when what is stored, or how, changes


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


def _entry(source: Path, kind: str, suffix: str) -> Path:
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT_VERSION}\0{kind}".encode())
    return cache_root() / "models" / f"{source.stem}.{kind}-{key.hexdigest()[:16]}{suffix}"


def gguf_metadata(source: Path, parse: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The file's metadata, as `parse()` returns it (plain msgpack-able values), from the cache if there."""
    entry = _entry(source, "metadata", ".msgpack")
    try:
        return msgpack.unpackb(entry.read_bytes(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as error:
        log.warning("unreadable metadata cache %s (%s); parsing the model file", entry, error)
    metadata = parse()
    try:
        packed = msgpack.packb(metadata, use_bin_type=True)
        write_atomically(entry, lambda path: Path(path).write_bytes(packed))
    except (OSError, TypeError, ValueError) as error:
        log.warning("could not cache the metadata of %s: %s", source, error)
    return metadata


def gguf_weights(source: Path, dtype: "torch.dtype", produce: Callable[[], Iterable[tuple[str, "torch.Tensor"]]]) -> Iterable[tuple[str, "torch.Tensor"]]:
    """The (name, tensor) pairs `produce()` gives for serving in `dtype`, from the cache if there."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    if os.environ.get(WEIGHTS_ENV) == "0":
        return produce()
    entry = _entry(source, f"weights-{str(dtype).removeprefix('torch.')}", ".safetensors")
    cached: Optional[dict] = None
    try:
        cached = load_file(entry)
    except FileNotFoundError:
        pass
    except (OSError, SafetensorError) as error:
        log.warning("unreadable weights cache %s (%s); reading the model file", entry, error)
    if cached is not None:
        return cached.items()
    tensors = {name: tensor.contiguous() for name, tensor in produce()}
    try:
        write_atomically(entry, lambda path: save_file(tensors, path))
        log.info("cached the weights of %s in %s (%.0f MiB)", source.name, entry, entry.stat().st_size / 2**20)
    except OSError as error:
        log.warning("could not cache the weights of %s: %s", source, error)
    return tensors.items()
