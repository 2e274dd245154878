"""Which prefill attention kernel a process takes where the CPU has AMX tiles but the OS does not
let it use them (engine/cpu_features.amx_unavailable_reason): each check faked in turn, so any
CPU runs these."""

from __future__ import annotations

import errno
import logging
import platform
import sys

import pytest
import torch

from engine import cpu_features, cpu_packing, prefill_attention
from engine.cpu_features import amx_unavailable_reason
from engine.prefill_attention import AMX, AVX512_BF16, kernel_kind

X86_64_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(not X86_64_LINUX, reason="AMX is checked only on x86_64 Linux")


@pytest.fixture(autouse=True)
def fresh_answer():
    """The answer is kept per process: each test asks anew, and leaves the real one behind."""
    amx_unavailable_reason.cache_clear()
    yield
    amx_unavailable_reason.cache_clear()


class FakeCpu:
    """torch's CPUID checks, /proc/cpuinfo's flags and Linux's answer to the permission request."""

    def __init__(self, monkeypatch, amx=True, avx512_bf16=True, amx_tile=True, permission_errno=0):
        self.requests = 0
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        flags = frozenset({"avx512f", "avx512_bf16", *(["amx_tile"] if amx_tile else [])})
        monkeypatch.setattr(cpu_features, "_cpuinfo_flags", lambda: flags)

        def request() -> int:
            self.requests += 1
            return permission_errno

        monkeypatch.setattr(cpu_features, "_request_tile_permission", request)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_amx_where_the_cpu_has_it_and_linux_grants_the_tile_state(monkeypatch, caplog):
    cpu = FakeCpu(monkeypatch)
    assert amx_unavailable_reason() is None
    assert kernel_kind() is AMX
    assert cpu_packing.bf16_kernel_max_rows() == cpu_packing.AMX_KERNEL_MAX_ROWS
    assert cpu.requests == 1  # asked once per process
    assert _warnings(caplog) == []


def test_tile_state_off_in_xcr0_takes_the_avx512_bf16_kernel(monkeypatch, caplog):
    """A VM or an old kernel: CPUID says AMX, Linux lists no amx_tile."""
    cpu = FakeCpu(monkeypatch, amx_tile=False)
    with caplog.at_level(logging.WARNING, logger=cpu_features.__name__):
        assert kernel_kind() is AVX512_BF16
        assert cpu_packing.bf16_kernel_max_rows() is None  # the bf16 kernel serves every batch
    assert "amx_tile" in amx_unavailable_reason() and "XCR0" in amx_unavailable_reason()
    assert cpu.requests == 0
    assert len(_warnings(caplog)) == 1 and "amx_tile" in _warnings(caplog)[0]


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM])
def test_permission_refused_takes_the_avx512_bf16_kernel_and_keeps_the_errno(
    monkeypatch, caplog, code
):
    FakeCpu(monkeypatch, permission_errno=code)
    with caplog.at_level(logging.WARNING, logger=cpu_features.__name__):
        assert kernel_kind() is AVX512_BF16
        kernel_kind()  # the answer is kept: one line
    reason = amx_unavailable_reason()
    assert f"errno {code}" in reason and "ARCH_REQ_XCOMP_PERM" in reason
    assert _warnings(caplog) == [
        f"the CPU has AMX tiles, but this process cannot use them: {reason}"
    ]


def test_no_kernel_where_amx_is_refused_and_there_is_no_avx512_bf16(monkeypatch):
    FakeCpu(monkeypatch, avx512_bf16=False, permission_errno=errno.EOPNOTSUPP)
    assert kernel_kind() is None


def test_a_cpu_without_amx_asks_nothing_and_logs_nothing(monkeypatch, caplog):
    cpu = FakeCpu(monkeypatch, amx=False, amx_tile=False)
    assert kernel_kind() is AVX512_BF16
    assert amx_unavailable_reason() == "the CPU has no AMX tiles (torch)"
    assert cpu.requests == 0 and _warnings(caplog) == []


def test_the_amx_kernel_refuses_to_load_without_the_tile_state(monkeypatch, tmp_path):
    """Whoever loads it directly (the self-check, a test) gets the reason, not a fault."""
    FakeCpu(monkeypatch, permission_errno=errno.EOPNOTSUPP)
    with pytest.raises(OSError, match=f"errno {errno.EOPNOTSUPP}"):
        prefill_attention.PrefillAttention(AMX, tmp_path / "never-opened.so")


def test_linux_grants_the_tile_state_exactly_where_it_lists_amx_tile():
    """The real request on this machine: refused (non-zero errno) where XCR0 lacks the state."""
    granted = cpu_features._request_tile_permission() == 0
    assert granted == ("amx_tile" in cpu_features._cpuinfo_flags())
