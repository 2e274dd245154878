"""Building a C kernel of engine/csrc into the disk cache: compiled with the system C compiler
the first time a process needs it (about a second), keyed by the source, the headers it may include,
the flags, the compiler and the CPU's features, and loaded with ctypes by its op's module
(engine/kernels.py checks each build before a worker uses it). What it was built with sits beside
it (`<so>.flags`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from engine.cpu_features import cpuinfo_flags_line
from engine.disk_cache import cache_root, write_atomically

CSRC = Path(__file__).parent / "csrc"
# Reassociation lets the compiler vectorize the dot products and sums (3x here); unlike -ffast-math
# it keeps infinities and NaNs meaningful.
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
# OpenMP threads a batch over torch's own OpenMP runtime; a compiler without OpenMP still gets the
# `omp simd` vectorization, single-threaded.
OPENMP_FLAGS = (("-fopenmp",), ("-fopenmp-simd",))


class KernelBuildError(RuntimeError):
    pass


def find_compiler() -> str:
    """The C compiler kernels are built with: `$CC`, else `cc`, else `gcc`."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelBuildError("no C compiler found (set CC)")
    return compiler


def build(
    compiler: Optional[str] = None,
    source: Path = CSRC / "paged_attention.c",
    extra_flags: tuple[str, ...] = (),
) -> Path:
    """Compiles `source` (a C file of engine/csrc, with CFLAGS and `extra_flags`) unless a build of
    it for this compiler and CPU is cached; returns the .so."""
    compiler = compiler or find_compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{compiler} --version failed: {exc}") from exc
    flags = (*CFLAGS, *extra_flags)
    # what it may include
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\0".join(
            [
                source.read_text(),
                *headers,
                " ".join(flags),
                str(OPENMP_FLAGS),
                version,
                cpuinfo_flags_line(),
            ]
        ).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    flags_file = Path(f"{target}.flags")  # what it was built with (engine/kernels.py reads it)
    if target.exists() and flags_file.exists():
        return target

    def compile_to(path: str) -> None:
        for openmp in OPENMP_FLAGS:
            result = subprocess.run(
                [compiler, *flags, *openmp, "-o", path, str(source), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode == 0:
                return
        raise KernelBuildError(
            f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}"
        )

    if not target.exists():
        write_atomically(target, compile_to)
    write_atomically(flags_file, lambda path: Path(path).write_text(" ".join(flags)))
    return target
