"""Every native kernel variant (each candidate of engine/kernels.py's chains) compiled for every x86
target we ship, with warnings as errors, on any machine: a CPU builds only its own `-march=native`
variants, so without this an error in the AVX2 or AMX code would first show on such a CPU. Nothing
here runs a kernel.

Also the AMX tile wrappers (engine/csrc/amx_tiles.h), which this machine may not be able to run:
checked in the assembly GCC makes of them, and the raw intrinsics they replace kept out of
engine/csrc."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

from engine import kernels, paged_attention
from engine.kernel_build import KernelBuildError, find_compiler

CSRC = Path(paged_attention.__file__).parent / "csrc"
WARNINGS_AS_ERRORS = ("-Wall", "-Wextra", "-Werror")
# The targets we ship, as compiler flags. GCC knows -march=znver4 only from 12.3: Zen 4 is spelled
# out as Zen 3 and its AVX-512 extensions, as -march=native reads it on a Zen 4 under GCC 12.2.
TARGETS = {
    "x86-64-v2": ("-march=x86-64-v2",),
    "x86-64-v3": ("-march=x86-64-v3",),  # AVX2
    "x86-64-v4": ("-march=x86-64-v4",),  # AVX-512
    "cooperlake": ("-march=cooperlake",),  # AVX512-BF16
    "sapphirerapids": ("-march=sapphirerapids",),  # AMX
    "znver4": (
        "-march=znver3",
        *(f"-mavx512{ext}" for ext in ("f", "cd", "bw", "dq", "vl", "ifma", "vbmi", "vbmi2")),
        *(f"-mavx512{ext}" for ext in ("vnni", "bitalg", "vpopcntdq", "bf16")),
        "-mgfni",
        "-mvaes",
        "-mvpclmulqdq",
    ),
}


class Variant(NamedTuple):
    name: str  # op-variant, as engine/kernels.py names its candidates
    source: Path
    flags: tuple[str, ...]  # the candidate's own, on top of paged_attention.build's
    # Macros the target must define: a candidate built with no ISA flags of its own is loaded only
    # on CPUs with these (by -march=native), so a target without them never builds it
    needs: tuple[str, ...] = ()


# engine/kernels.py's `unavailable` checks of the candidates built by -march=native alone
_NATIVE_NEEDS = {"linear_f32": ("__AVX2__", "__FMA__"), "linear_bf16": ("__AVX512BF16__",)}
# every candidate of every op's chain: what any CPU may build
VARIANTS = tuple(
    Variant(f"{c.op}-{c.variant}", c.source, c.extra_flags, _NATIVE_NEEDS.get(c.op, ()))
    for chain in kernels.CHAINS.values()
    for c in chain
)


def _compiler() -> str:
    """The compiler the kernels are built with (engine/kernel_build.find_compiler)."""
    try:
        compiler = find_compiler()
    except KernelBuildError as error:
        pytest.fail(f"{error}: the kernels cannot be built")
    if not shutil.which(compiler):
        pytest.fail(f"no C compiler {compiler}: the kernels cannot be built")
    return compiler


def _flags(target: str) -> tuple[str, ...]:
    """build's flags with -march=native replaced by the target's, and -c for -shared."""
    assert "-march=native" in paged_attention.CFLAGS
    kept = (flag for flag in paged_attention.CFLAGS if flag not in ("-march=native", "-shared"))
    return (*kept, *TARGETS[target], paged_attention.OPENMP_FLAGS[0][0], *WARNINGS_AS_ERRORS)


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


class TargetBuilds(NamedTuple):
    errors: dict[str, str]  # variant -> the compiler's complaint
    not_built: dict[str, str]  # variant -> why the target has no such build


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, TargetBuilds]:
    """Every (variant, target) compiled with -c, two at a time."""
    compiler, out = _compiler(), tmp_path_factory.mktemp("kernel_builds")

    def macros(target: str) -> subprocess.CompletedProcess:
        return _run([compiler, *TARGETS[target], "-dM", "-E", "-x", "c", os.devnull])

    def compile_one(variant: Variant, target: str) -> Optional[str]:
        obj = out / f"{variant.name}-{target}.o"
        result = _run(
            [compiler, *_flags(target), *variant.flags, "-c", str(variant.source), "-o", str(obj)]
        )
        return None if result.returncode == 0 else result.stderr.strip()[-3000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        defined = dict(zip(TARGETS, pool.map(macros, TARGETS)))
        results: dict[str, TargetBuilds] = {}
        jobs = {}
        for target, probe in defined.items():
            results[target] = TargetBuilds({}, {})
            if probe.returncode != 0:
                results[target].errors["*"] = (
                    f"{compiler} does not know target {target} ({' '.join(TARGETS[target])}): "
                    f"{probe.stderr.strip()}"
                )
                continue
            for variant in VARIANTS:
                missing = [m for m in variant.needs if f"#define {m} " not in probe.stdout]
                if missing:
                    results[target].not_built[variant.name] = f"{target} lacks {', '.join(missing)}"
                else:
                    jobs[variant.name, target] = pool.submit(compile_one, variant, target)
        for (name, target), job in jobs.items():
            if (error := job.result()) is not None:
                results[target].errors[name] = error
    return results


def test_every_kernel_source_has_a_variant():
    assert {path.name for path in CSRC.glob("*.c")} == {v.source.name for v in VARIANTS}


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_variant_compiles_for(target, builds):
    errors = builds[target].errors
    assert not errors, "\n\n".join(
        f"{name} for {target}:\n{error}" for name, error in errors.items()
    )


def test_each_variant_is_built_for_some_target(builds):
    """A variant whose `needs` no target meets would never be compiled here."""
    for variant in VARIANTS:
        assert any(variant.name not in b.not_built for b in builds.values()), variant.name
    # those only native builds make, for the CPUs that have their ISA
    assert builds["x86-64-v2"].not_built.keys() == {"linear_f32-kernel", "linear_bf16-kernel"}
    assert builds["sapphirerapids"].not_built == {}


# ---- the AMX wrappers ----------------------------------------------------------------------------

# Code where GCC 12's own intrinsics lose stores (issue 51): a config built in memory and only read
# by ldtilecfg; a buffer written and only read by a tile load (constant and run-time strides); a
# buffer written before a tile store and read after it (in the gap between its rows, and in a row).
AMX_PROBE = """
#include "amx_tiles.h"

void probe_config(void) {
    amx_tile_config config = {
        .palette_id = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    amx_load_config(&config);
}

void probe_load(void) {
    _Alignas(64) char tile[1024];
    for (int i = 0; i < (int)sizeof tile; i++) tile[i] = (char)(3 * i + 1);
    amx_tile_load(6, tile, 64);
}

void probe_load_strided(int64_t stride) {
    _Alignas(64) char rows[16 * 256];
    for (int i = 0; i < (int)sizeof rows; i++) rows[i] = (char)(3 * i + 1);
    amx_tile_load(6, rows, stride);
}

float probe_store(void) {
    _Alignas(64) float s[16 * 32];
    s[5] = 1.f;
    s[20] = 2.f;
    amx_tile_store(4, s, 128);
    return s[5] + s[20];
}
"""
_VECTOR_BYTES = {"xmm": 16, "ymm": 32, "zmm": 64}
_SUFFIX_BYTES = {"b": 1, "w": 2, "l": 4, "q": 8}


def _function(assembly: str, name: str) -> list[str]:
    """The instructions of `name` in GCC's AT&T output, one a line: mnemonic and operands."""
    body = assembly.split(f"\n{name}:\n", 1)[1].split(".cfi_endproc", 1)[0]
    return [line.strip() for line in body.splitlines() if line.strip()[:1] not in ("", ".")]


def _bytes_stored(instruction: str) -> int:
    """How many bytes an instruction writes to memory (0: none): a move or string store whose
    destination, the last AT&T operand, is a memory reference."""
    mnemonic, _, operands = instruction.partition("\t")
    if not re.match(r"(rep )?v?(mov|stos)", mnemonic) or not operands.rstrip().endswith(")"):
        return 0
    if vector := re.match(r"%([xyz]mm)", operands):
        return _VECTOR_BYTES[vector[1]]
    return _SUFFIX_BYTES.get(mnemonic[-1], 1)


def _stored_before(instructions: list[str], mnemonic: str) -> int:
    index = next(i for i, line in enumerate(instructions) if line.startswith(mnemonic))
    return sum(_bytes_stored(line) for line in instructions[:index])


@pytest.mark.parametrize("level", ["-O1", "-O2", "-O3"])
def test_amx_wrappers_keep_the_memory_their_tiles_read_and_write(level, tmp_path):
    source = tmp_path / "probe.c"
    source.write_text(AMX_PROBE)
    command = [_compiler(), level, *TARGETS["sapphirerapids"], *WARNINGS_AS_ERRORS, f"-I{CSRC}"]
    result = _run([*command, "-S", "-o", "-", str(source)])
    assert result.returncode == 0, result.stderr
    assembly = result.stdout

    assert _stored_before(_function(assembly, "probe_config"), "ldtilecfg") >= 64
    assert _stored_before(_function(assembly, "probe_load"), "tileloadd") > 0
    assert _stored_before(_function(assembly, "probe_load_strided"), "tileloadd") > 0
    store = _function(assembly, "probe_store")
    assert _stored_before(store, "tilestored") >= 8  # s[5] and s[20]
    after = store[next(i for i, line in enumerate(store) if line.startswith("tilestored")) :]
    # both read back from memory, not folded to 3.0
    assert sum("(%" in line and _bytes_stored(line) == 0 for line in after) >= 2


def test_the_amx_kernel_fills_its_whole_tile_config_before_loading_it():
    """The crash of issue 51, where it happened: configure_tiles, called through a pointer."""
    amx = next(c for c in kernels.CHAINS["prefill_attention"] if c.variant == "amx")
    command = [_compiler(), *_flags("sapphirerapids"), *amx.extra_flags, "-S", "-o", "-"]
    result = _run([*command, str(amx.source)])
    assert result.returncode == 0, result.stderr
    assert _stored_before(_function(result.stdout, "configure_tiles"), "ldtilecfg") >= 64


# Raw tile intrinsics, or tile instructions in an asm, anywhere but the wrapper header
_RAW_AMX = re.compile(r"\b_tile_\w+|\b(ldtilecfg|sttilecfg|tileload\w*|tilestore\w*|tdp\w+)\b")


def _code(source: str) -> str:
    """C source with its comments blanked, newlines kept (so line numbers hold)."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m[0]), source, flags=re.S)


def test_only_the_wrapper_header_touches_amx_tiles():
    assert _RAW_AMX.search(_code("_tile_loadd(6, p, 64);"))
    assert _RAW_AMX.search(_code('__asm__ volatile("ldtilecfg %0" : : "m"(*c));'))
    assert not _RAW_AMX.search(_code("/* _tile_loadd drops stores */ amx_tile_load(6, p, 64);"))
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(CSRC.iterdir())
        if path.suffix in (".c", ".h") and path.name != "amx_tiles.h"
        for number, line in enumerate(_code(path.read_text()).splitlines(), 1)
        if _RAW_AMX.search(line)
    ]
    assert not offenders, "use amx_tiles.h's wrappers:\n" + "\n".join(offenders)
