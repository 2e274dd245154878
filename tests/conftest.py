import os
import tempfile

# Keep every Ray server of the test run on loopback; Ray reads this when it is first imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Every process of the run (this one, the kernels' self-checks, Ray's workers) lists the kernel
# builds it loads here: the log ends with the variants the run executed (engine/kernels.py).
os.environ["PDSERVE_KERNEL_RECORD"] = tempfile.mkdtemp(prefix="pdserve-kernels-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

# Tests share two cores with whatever else runs; one intra-op thread keeps them predictable.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """Modules marked `own_ray_cluster` (they shut the session's shared cluster down and start their
    own) run first, so the shared one starts once: each start of it costs 10-20 s on this repo's
    machines."""
    # stable: order kept otherwise
    items.sort(key=lambda item: item.get_closest_marker("own_ray_cluster") is None)


@pytest.fixture(scope="session")
def default_gguf():
    from engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_fp32():
    """The default model loaded once, fp32 (the precision the HF comparisons need)."""
    from engine.weights import load_model

    return load_model("default", torch.float32)


@pytest.fixture(scope="session")
def hf_smollm_fp32(default_gguf):
    from tests.hf_reference import hf_model

    # transformers' own reading of the GGUF file, converted once
    return hf_model(default_gguf, torch.float32)


@pytest.fixture(scope="session")
def shared_harness(tmp_path_factory):
    """One local Ray cluster and router event loop for the session: starting Ray takes ~5 s, and 17
    modules serve systems."""
    from tests.serving_harness import Harness

    h = Harness(str(tmp_path_factory.mktemp("cores")))
    yield h
    h.close()


@pytest.fixture(scope="module")
def harness(shared_harness):
    """The session's harness for one test module's pdserve systems; those still up when it ends are
    stopped."""
    yield shared_harness
    shared_harness.stop_systems()


# Seconds per test file (setup, call and teardown together), for the log's summary: the suite has a
# 15-minute budget, and module-scoped systems put most of a file's time in its first test's setup.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    slowest = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:15]
    terminalreporter.section("slowest 15 files")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    _kernel_variants(terminalreporter)


def _kernel_variants(terminalreporter):
    """The native kernel variants this run loaded and ran (each is run against a float64 reference
    by its self-check or its test), with the CPU they ran on: what a green run covered."""
    import collections
    from pathlib import Path

    from engine.kernels import name_of

    processes = collections.Counter()
    for listing in Path(os.environ["PDSERVE_KERNEL_RECORD"]).glob("*.txt"):
        for name in {name_of(*line.split("\t", 1)) for line in listing.read_text().splitlines()}:
            processes[name] += 1
    terminalreporter.section("kernel variants executed")
    terminalreporter.write_line(
        f"CPU: {torch.backends.cpu.get_cpu_capability()}, AVX512_BF16 "
        f"{torch.cpu._is_avx512_bf16_supported()}, AMX tiles {torch.cpu._is_amx_tile_supported()}"
    )
    for name, count in sorted(processes.items()):
        terminalreporter.write_line(f"  {name}: loaded by {count} process(es)")
    if not processes:
        terminalreporter.write_line("  none")
