"""Native kernels that can never take a worker down: each op's chain of candidates, a self-check of
every build in a child process before any worker uses it, and crash attribution at run time.

An op (`OPS`) has candidates, best first; where none is usable the op's torch path runs:

    prefill_attention  amx -> avx512-bf16 -> torch
    decode_attention   native -> avx2 -> plain -> torch  (the AVX-512, the AVX2 path, plain loops)
    linear_bf16        kernel -> oneDNN
    linear_f32         kernel -> MKL
    fused_ops          kernel -> torch

`select(op, load)` walks the chain: a candidate this CPU cannot run is passed over; one it can is
built (engine/paged_attention.build), then run by `python -m engine.kernel_check` in a child process
against a float64 reference on every path of that build (tails, GQA groups, partial blocks, cached
context, one and two threads, canary bytes around each output). The verdict (ok / signal / wrong /
timeout / error) is cached beside the `.so`, keyed by the check's own source and this CPU's
signature (its flags, the kernel release, the xsave features Linux supports and permits: AMX's tile
state among them), so each build is checked once per node: a file lock makes the node's other
processes wait for the first one's verdict, failures included. Each fallback logs one line: which
kernel, why, what runs instead, and the knobs (`SKIP_ENV`, `FORCE_ENV`).

At run time a worker (runtime/startup.py) calls `watch_crashes()`: Python's faulthandler writes the
stacks of a fatal signal to a per-process file, and the process lists the libraries it loaded beside
it. The next worker to start on the node (the healer's replacement) reads the files of processes
that have died: a stack inside a kernel's call marks that build bad, as a failed check would, so
the replacement takes the next candidate and the request migrated to it succeeds. No cascade.

A kernel that returns an error code raises `KernelFailed`: the op is disabled in this process (one
log line) and the caller recomputes that call with torch.

Knobs: `PDSERVE_DISABLE_KERNELS=1` (every op on torch); `PDSERVE_KERNEL_SKIP=op[:variant],...`
(passes over those candidates); `PDSERVE_KERNEL_FORCE=op:variant,...` (uses a candidate whatever
its verdict, unchecked); `PDSERVE_KERNEL_FAULT=op[:runtime]` (tests: the op's first candidate is
built as its own library whose calls raise SIGSEGV, in the self-check too, or with `:runtime` only
outside it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

from engine.cpu_features import amx_unavailable_reason, cpuinfo_flags_line
from engine.disk_cache import cache_root, write_atomically
from engine.kernel_build import CSRC, build
from engine.kernel_env import (
    DISABLE_ENV,
    FAULT_ENV,
    FORCE_ENV,
    RECORD_ENV,
    SELF_CHECK_ENV,
    SKIP_ENV,
)

log = logging.getLogger(__name__)


CHECK_TIMEOUT_S = 120.0
# the op each kernel-calling module's frames belong to, for crash attribution
_CALLER_OPS = {
    "prefill_attention.py": ("prefill_attention",),
    "paged_attention.py": ("decode_attention",),
    "fused_ops.py": ("fused_ops",),
    "cpu_packing.py": ("linear_bf16", "linear_f32"),
}


class KernelFailed(RuntimeError):
    """A kernel returned an error code: its op now runs on torch in this process."""


def _has_avx2_fma() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in ("AVX2", "AVX512") and " fma " in f"{cpuinfo_flags_line()} "


def _avx512_bf16() -> Optional[str]:
    return None if torch.cpu._is_avx512_bf16_supported() else "the CPU has no AVX512_BF16"


def _avx2() -> Optional[str]:
    return None if _has_avx2_fma() else "the CPU has no AVX2 with FMA"


def _x86() -> Optional[str]:
    return None if platform.machine() in ("x86_64", "AMD64") else "not an x86-64 CPU"


@dataclass(frozen=True)
class Candidate:
    op: str
    variant: str  # as logs, /metrics and benchmarks name it
    source: Path
    extra_flags: tuple[str, ...] = ()
    # None where this CPU can run it, else why not
    unavailable: Callable[[], Optional[str]] = _x86


_PREFILL_FLAGS = ("-mavx512f", "-mavx512bf16")
CHAINS: dict[str, tuple[Candidate, ...]] = {
    "prefill_attention": (
        Candidate(
            "prefill_attention",
            "amx",
            CSRC / "prefill_attention_amx.c",
            ("-mamx-tile", "-mamx-bf16", *_PREFILL_FLAGS),
            amx_unavailable_reason,
        ),
        Candidate(
            "prefill_attention",
            "avx512-bf16",
            CSRC / "prefill_attention_avx512.c",
            _PREFILL_FLAGS,
            _avx512_bf16,
        ),
    ),
    "decode_attention": (
        Candidate("decode_attention", "native", CSRC / "paged_attention.c"),
        Candidate("decode_attention", "avx2", CSRC / "paged_attention.c", ("-DPDSERVE_NO_AVX512",)),
        Candidate(
            "decode_attention", "plain", CSRC / "paged_attention.c", ("-DPDSERVE_PLAIN_LOOPS",)
        ),
    ),
    "linear_bf16": (
        Candidate("linear_bf16", "kernel", CSRC / "decode_linear_bf16.c", (), _avx512_bf16),
    ),
    "linear_f32": (Candidate("linear_f32", "kernel", CSRC / "decode_linear.c", (), _avx2),),
    # Finite math: SiLU's exp vectorizes 7x faster with it (0.64 against 4.5 ms for [512, 1536]
    # here). A NaN or infinite activation then gives an undefined (not a NaN) result: the model has
    # failed either way.
    "fused_ops": (
        Candidate("fused_ops", "kernel", CSRC / "elementwise.c", ("-ffinite-math-only",)),
    ),
}
OPS = tuple(CHAINS)


def candidate(op: str, variant: str) -> Candidate:
    """One candidate of CHAINS by name: its source and flags are defined there only."""
    return next(c for c in CHAINS[op] if c.variant == variant)


# what runs when no candidate is usable
FALLBACKS = {
    "prefill_attention": "torch",
    "decode_attention": "torch (gather + SDPA)",
    "linear_bf16": "oneDNN",
    "linear_f32": "MKL",
    "fused_ops": "torch",
}


@dataclass(frozen=True)
class Verdict:
    status: str  # "ok", "signal", "wrong", "timeout" or "error"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class Chosen:
    """An op's choice in this process: the candidate and its library (None: the fallback)."""

    op: str
    variant: str
    library: Optional[Path] = None
    reason: str = ""  # why not the first candidate, where it is not
    failed: bool = False  # a run-time error code disabled it


_chosen: dict[str, Chosen] = {}
_lock = threading.Lock()
_manifest: Optional[Path] = None  # watch_crashes(): where this process lists its libraries

T = TypeVar("T")


def _env_pairs(name: str) -> set[tuple[str, str]]:
    """`op[:variant],...` as (op, variant or "*") pairs."""
    pairs = set()
    for item in filter(None, (part.strip() for part in os.environ.get(name, "").split(","))):
        op, _, variant = item.partition(":")
        pairs.add((op, variant or "*"))
    return pairs


def _listed(pairs: set[tuple[str, str]], candidate: Candidate) -> bool:
    return (candidate.op, "*") in pairs or (candidate.op, candidate.variant) in pairs


def _fault_mode(candidate: Candidate) -> Optional[str]:
    """Where PDSERVE_KERNEL_FAULT names this candidate's op and it is the first this CPU can run:
    "check" (it faults in its self-check too) or "runtime"."""
    for op, mode in _env_pairs(FAULT_ENV):
        if op != candidate.op:
            continue
        first = next((c for c in CHAINS[op] if c.unavailable() is None), None)
        if first == candidate:
            # a tag (`op:runtime:tag`) makes a library of its own, whose verdicts start afresh
            tag = hashlib.sha256(mode.encode()).hexdigest()[:8]
            return f"{'runtime' if mode.startswith('runtime') else 'check'}={tag}"
    return None


def build_candidate(candidate: Candidate) -> Path:
    fault = _fault_mode(candidate)
    # a faulting build is a library of its own: its verdicts never touch the real one's
    flags = (*candidate.extra_flags, f"-DPDSERVE_KERNEL_FAULT_{fault.upper()}") if fault else ()
    return build(source=candidate.source, extra_flags=flags or candidate.extra_flags)


def select(op: str, load: Callable[[Path, str], T]) -> Optional[T]:
    """The op's first usable candidate, loaded by `load(library, variant)` (a ctypes wrapper); None:
    the op's fallback runs. Memoized per process by the op's callers (lru_cache)."""
    with _lock:
        return _select(op, load)


def _select(op: str, load: Callable[[Path, str], T]) -> Optional[T]:
    if os.environ.get(DISABLE_ENV) == "1":
        _chosen[op] = Chosen(op, FALLBACKS[op], reason=f"{DISABLE_ENV}=1")
        return None
    attribute_crashes()
    skip, force = _env_pairs(SKIP_ENV), _env_pairs(FORCE_ENV)
    passed_over: list[str] = []
    for candidate in CHAINS[op]:
        why_not = candidate.unavailable()
        if why_not is not None:
            continue  # not this CPU's: no log line, the ISA choice is silent
        if _listed(skip, candidate):
            why_not = f"skipped by {SKIP_ENV}"
        else:
            try:
                library = build_candidate(candidate)
                forced = _listed(force, candidate)
                verdict = Verdict("ok", "forced") if forced else check(candidate, library)
                if verdict.ok:
                    kernel = load(library, candidate.variant)
                    _remember(Chosen(op, candidate.variant, library, "; ".join(passed_over)))
                    return kernel
                why_not = f"its self-check says {verdict.status}: {verdict.detail}"
            except Exception as error:  # a build, a load or a missing symbol: the next one
                why_not = f"{type(error).__name__}: {error}"
        nxt = _next_name(candidate)
        log.warning(
            "%s kernel %s not used (%s); %s runs instead. %s=%s:%s skips it, %s=%s:%s forces it",
            op,
            candidate.variant,
            why_not,
            nxt,
            SKIP_ENV,
            op,
            candidate.variant,
            FORCE_ENV,
            op,
            candidate.variant,
        )
        passed_over.append(f"{candidate.variant}: {why_not}")
    _remember(Chosen(op, FALLBACKS[op], None, "; ".join(passed_over)))
    return None


def _next_name(candidate: Candidate) -> str:
    chain = CHAINS[candidate.op]
    rest = chain[chain.index(candidate) + 1 :]
    usable = [c.variant for c in rest if c.unavailable() is None]
    return f"the {usable[0]} kernel" if usable else FALLBACKS[candidate.op]


def _remember(chosen: Chosen) -> None:
    _chosen[chosen.op] = chosen
    if chosen.library is None or _manifest is None:
        return
    try:
        with open(_manifest, "a") as file:
            file.write(f"{chosen.op} {chosen.variant} {chosen.library}\n")
    except OSError as error:
        log.warning("could not list %s in %s: %s", chosen.library, _manifest, error)


def name_of(source_stem: str, flags: str) -> str:
    """`op variant` for a build of `source_stem` with `flags` (as its `.flags` file holds them),
    where it is one of CHAINS's candidates; else the source and its distinguishing flags."""
    given = set(flags.split())
    for candidate in (c for chain in CHAINS.values() for c in chain):
        wanted = set(candidate.extra_flags)
        others = {f for c in CHAINS[candidate.op] for f in c.extra_flags} - wanted
        if candidate.source.stem == source_stem and wanted <= given and not others & given:
            return f"{candidate.op} {candidate.variant}"
    extra = [f for f in flags.split() if f.startswith("-D")]
    return " ".join([source_stem, *extra])


def _record_load(library: Path) -> None:
    """Tests (`RECORD_ENV`): each process lists the builds it loaded, to run them (tests/conftest.py
    sums the variants a run executed)."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    try:
        with open(Path(folder) / f"{os.getpid()}.txt", "a") as file:
            file.write(f"{library.name.rsplit('-', 1)[0]}\t{_flags_of(library)}\n")
    except OSError as error:
        log.warning("could not record the load of %s: %s", library, error)


def chosen() -> dict[str, Chosen]:
    """What this process runs for each op it has selected so far."""
    return dict(_chosen)


def summary() -> tuple[tuple[str, str], ...]:
    """(op, variant) for each op selected so far, failed ones as their fallback."""
    return tuple(
        (op, f"{FALLBACKS[op]} (kernel failed)" if c.failed else c.variant)
        for op, c in sorted(_chosen.items())
    )


def disable(op: str, error: str) -> None:
    """A kernel of `op` returned an error: torch serves the op from now on in this process."""
    with _lock:
        current = _chosen.get(op)
        if current is None or current.failed:
            return
        current.failed = True
    log.error(
        "%s kernel %s failed (%s); %s runs instead in this process",
        op,
        current.variant,
        error,
        FALLBACKS[op],
    )


def is_disabled(op: str) -> bool:
    current = _chosen.get(op)
    return current is not None and current.failed


def open_library(library: Path) -> ctypes.CDLL:
    """The build loaded, its functions faulting where PDSERVE_KERNEL_FAULT built it to."""
    lib = ctypes.CDLL(str(library))
    _record_load(library)
    return _FaultingLibrary(lib, library) if "-DPDSERVE_KERNEL_FAULT" in _flags_of(library) else lib


def _flags_of(library: Path) -> str:
    try:
        return Path(f"{library}.flags").read_text()
    except OSError:
        return ""


class _FaultingLibrary:
    """Tests: each kernel function of this library dies by SIGSEGV in native code when called (in
    the self-check too, or only outside it); init functions answer as they would."""

    def __init__(self, lib: ctypes.CDLL, library: Path):
        self._lib = lib
        self._runtime_only = "-DPDSERVE_KERNEL_FAULT_RUNTIME" in _flags_of(library)

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        if name.endswith("_init"):
            return fn
        return _FaultingFunction(fn, self._runtime_only)


class _FaultingFunction:
    def __init__(self, fn, runtime_only: bool):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_runtime_only", runtime_only)

    def __setattr__(self, name, value):  # argtypes, restype
        setattr(self._fn, name, value)

    def __call__(self, *args):
        if not (self._runtime_only and os.environ.get(SELF_CHECK_ENV) == "1"):
            ctypes.string_at(0)  # a read of address 0: SIGSEGV
        return self._fn(*args)


# ---- the self-check's verdicts


def _xsave_features() -> str:
    """The xsave features Linux supports (XCR0 and XFD's), by arch_prctl(ARCH_GET_XCOMP_SUPP):
    AMX's tile state is bits 17-18. (Not the process's permission, ARCH_GET_XCOMP_PERM: it changes
    once a process asks for the tiles, which would give one node two keys.)"""
    if platform.machine() != "x86_64" or sys.platform != "linux":
        return "n/a"
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    ok = libc.syscall(158, 0x1021, ctypes.byref(mask)) == 0
    return hex(mask.value) if ok else f"errno {ctypes.get_errno()}"


def cpu_signature() -> str:
    """The CPU and OS as a build's verdict depends on them: flags, kernel release, the xsave
    features Linux supports, and whether Linux grants this node's processes AMX's tiles."""
    amx = "amx granted" if amx_unavailable_reason() is None else "no amx"
    return "\0".join([cpuinfo_flags_line(), platform.release(), _xsave_features(), amx])


@lru_cache(maxsize=1)
def _verdict_key() -> str:
    """Constant for the process: read once (it reads /proc/cpuinfo and the check's source)."""
    check_source = (Path(__file__).parent / "kernel_check.py").read_bytes()
    return hashlib.sha256(check_source + cpu_signature().encode()).hexdigest()[:16]


def _verdict_path(library: Path) -> Path:
    return library.with_name(library.name + ".check.json")


def cached_verdict(library: Path) -> Optional[Verdict]:
    try:
        data = json.loads(_verdict_path(library).read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != _verdict_key():
        return None
    return Verdict(data["status"], data.get("detail", ""))


def store_verdict(library: Path, verdict: Verdict) -> None:
    text = json.dumps({"key": _verdict_key(), **dataclasses.asdict(verdict)})
    write_atomically(_verdict_path(library), lambda path: Path(path).write_text(text))


def check(candidate: Candidate, library: Path) -> Verdict:
    """The build's verdict: cached, or from a self-check run now (one per node at a time)."""
    verdict = cached_verdict(library)
    if verdict is not None:
        return verdict
    with open(library.with_name(library.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process checking it now: wait for its verdict
        verdict = cached_verdict(library)
        if verdict is None:
            verdict = run_check(candidate, library)
            store_verdict(library, verdict)
            if verdict.ok:
                log.info("%s kernel %s passed its self-check", candidate.op, candidate.variant)
    return verdict


def run_check(candidate: Candidate, library: Path) -> Verdict:
    """`python -m engine.kernel_check` on the build, in a child process."""
    env = {**os.environ, SELF_CHECK_ENV: "1", "OMP_NUM_THREADS": "2"}
    command = [
        sys.executable,
        "-m",
        "engine.kernel_check",
        candidate.op,
        candidate.variant,
        str(library),
    ]
    try:
        result = subprocess.run(
            command,
            cwd=Path(__file__).parent.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Verdict("timeout", f"no answer within {CHECK_TIMEOUT_S:.0f} s")
    last = (result.stdout.strip().splitlines() or [""])[-1]
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        return Verdict("signal", f"the check died by {name}; it had reached: {last or 'start'}")
    if result.returncode == 0 and last.startswith("ok"):
        return Verdict("ok", last)
    if last.startswith("wrong"):
        return Verdict("wrong", last)
    return Verdict("error", (result.stderr.strip().splitlines() or [last])[-1][-500:])


# ---- crash attribution


def _crash_dir() -> Path:
    return cache_root() / "kernels" / "crashes"


def watch_crashes() -> None:
    """A worker's start: marks the builds that killed this node's dead processes bad, then has
    faulthandler write this process's stacks on a fatal signal beside the list of the libraries it
    loads."""
    global _manifest
    folder = _crash_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        attribute_crashes()
        stacks = open(folder / f"{os.getpid()}.stacks", "w")  # held for the process's life
        _manifest = folder / f"{os.getpid()}.libraries"
        _manifest.write_text("")
        faulthandler.enable(file=stacks, all_threads=True)
    except OSError as error:
        log.warning("kernel crashes on this node will not be attributed: %s", error)
        return
    for chosen_ in _chosen.values():  # selected before the watch began
        _remember(chosen_)


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


_FRAME = re.compile(r'File "([^"]+)", line \d+ in (\w+)')


def attribute_crashes() -> None:
    """Reads the stacks of this node's dead processes: a fatal signal inside a kernel's call marks
    its build bad."""
    folder = _crash_dir()
    if not folder.is_dir():
        return
    for stacks in folder.glob("*.stacks"):
        pid = int(stacks.stem) if stacks.stem.isdigit() else 0
        if pid == os.getpid():
            continue
        alive = _alive(pid)
        libraries = stacks.with_suffix(".libraries")
        try:
            # empty until a fatal signal: its process is dying or dead once it is not
            crashed = stacks.stat().st_size > 0 and stacks.name not in _attributed
            text = stacks.read_text(errors="replace") if crashed else ""
            if "Fatal Python error" in text:
                _attributed.add(stacks.name)
                _attribute(pid, text, _loaded(libraries))
        except OSError:
            pass
        if not alive:
            for path in (stacks, libraries):
                try:
                    path.unlink()
                except OSError:
                    pass


_attributed: set[str] = set()  # stacks files this process has attributed
_verdicts_seen: Optional[int] = None  # the kernels folder's mtime at the last refresh


def refresh() -> None:
    """A worker admitting a request: a build it runs that has killed another process of the node
    since it was chosen (as attributed by this call or by any other process) is disabled here, so
    a request migrated from the dead worker cannot reach it (torch serves the op from now on; the
    worker's replacement takes the next candidate). Cheap: a few small files."""
    global _verdicts_seen
    if _manifest is None:  # not a worker watching for crashes
        return
    attribute_crashes()
    # a verdict is written by a rename into the kernels folder: unchanged, nothing to re-read
    try:
        stamp = _manifest.parent.parent.stat().st_mtime_ns
    except OSError:
        stamp = None
    if stamp is not None and stamp == _verdicts_seen:
        return
    _verdicts_seen = stamp
    forced = _env_pairs(FORCE_ENV)
    for op, current in list(_chosen.items()):
        if current.library is None or current.failed or (op, current.variant) in forced:
            continue
        verdict = cached_verdict(current.library)
        if verdict is not None and not verdict.ok:
            disable(op, f"marked bad on this node: {verdict.detail}")


def _loaded(libraries: Path) -> list[list[str]]:
    """A dead process's list of its builds: (op, variant, library) per line."""
    return [line.split(" ", 2) for line in libraries.read_text().splitlines() if line.strip()]


def _attribute(pid: int, text: str, loaded: list[list[str]]) -> None:
    kind = text.split("Fatal Python error:", 1)[1].strip().splitlines()[0]
    ops = {
        op for file, _ in _FRAME.findall(text) for op in _CALLER_OPS.get(os.path.basename(file), ())
    }
    for op, variant, library in (entry for entry in loaded if len(entry) == 3):
        if op not in ops:
            continue
        detail = f"process {pid} died by {kind} inside it at run time"
        try:
            store_verdict(Path(library), Verdict("signal", detail))
        except OSError as error:
            log.warning("could not mark %s bad: %s", library, error)
            continue
        log.error("%s kernel %s marked bad on this node: %s", op, variant, detail)
