"""A native kernel can never take a worker down (engine/kernels.py): a build that crashes its
self-check is passed over for the next candidate with one log line; one that crashes a worker at run
time is marked bad on the node, the worker's replacement takes the next candidate, and the request
migrated to it succeeds with identical output; an error code falls back to torch in-process."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.kernel_env import FAULT_ENV
from engine.paged_attention import PagedDecodeAttention

REPO = Path(__file__).parent.parent


@pytest.fixture
def fresh_choices(monkeypatch):
    """This process's choices emptied for the test and restored after it (select's state is
    per process)."""
    saved = dict(kernels._chosen)
    kernels._chosen.clear()
    yield
    kernels._chosen.clear()
    kernels._chosen.update(saved)


def _decode(library: Path, variant: str) -> PagedDecodeAttention:
    return PagedDecodeAttention(library)


def _first_decode_variant() -> str:
    return next(c.variant for c in kernels.CHAINS["decode_attention"] if c.unavailable() is None)


def test_a_build_that_crashes_its_self_check_is_passed_over(monkeypatch, caplog, fresh_choices):
    # a tag of this run's own: a new faulting library, checked afresh
    monkeypatch.setenv(FAULT_ENV, f"decode_attention:check{uuid.uuid4().hex[:8]}")
    first = _first_decode_variant()
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        kernel = kernels.select("decode_attention", _decode)
    chosen = kernels.chosen()["decode_attention"]
    assert kernel is not None and chosen.variant != first, chosen
    assert f"{first}: its self-check says signal: the check died by SIGSEGV" in chosen.reason
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"decode_attention kernel {first} not used" in lines[0]
    assert f"the {chosen.variant} kernel runs instead" in lines[0]
    assert "PDSERVE_KERNEL_SKIP=decode_attention:" in lines[0]
    # the next candidate serves: one sequence's attention against a plain torch one
    q, k_cache, v_cache = (
        torch.randn(1, 9, 64),
        torch.randn(2, 16, 3, 64),
        torch.randn(2, 16, 3, 64),
    )
    got = kernel(q, k_cache, v_cache, torch.tensor([[1, 0]]), torch.tensor([20]), 0.125)
    keys = k_cache[[1, 0]].flatten(0, 1)[:20].repeat_interleave(3, 1)
    values = v_cache[[1, 0]].flatten(0, 1)[:20].repeat_interleave(3, 1)
    scores = torch.einsum("hd,nhd->hn", q[0], keys) * 0.125
    want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=0)


def test_a_crash_at_run_time_marks_the_build_bad_for_the_next_process(monkeypatch, fresh_choices):
    fault = f"decode_attention:runtime{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(FAULT_ENV, fault)
    first = _first_decode_variant()
    crasher = textwrap.dedent(
        """
        import torch
        from engine import kernels
        from engine.paged_attention import load_kernel
        kernels.watch_crashes()
        kernel = load_kernel()
        print(kernels.chosen()["decode_attention"].variant, flush=True)
        q, cache = torch.randn(1, 9, 64), torch.randn(2, 16, 3, 64)
        kernel(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([5]), 0.1)
        print("survived", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", crasher], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    # its self-check passed (the fault waits for run time), then its first call killed it
    assert result.stdout.split() == [first], (result.stdout, result.stderr[-2000:])
    assert result.returncode == -11, result.returncode
    kernel = kernels.select("decode_attention", _decode)  # this process: the next on the node
    chosen = kernels.chosen()["decode_attention"]
    assert kernel is not None and chosen.variant != first
    assert "inside it at run time" in chosen.reason, chosen.reason


def test_an_error_code_falls_back_to_torch_in_process(fresh_choices):
    from engine.model import ForwardBatch
    from tests.attention_shapes import attention_layer

    kernel = kernels.select("decode_attention", _decode)
    assert kernel is not None
    # a head size over the kernel's maximum: it returns an error code, never garbage
    with pytest.raises(kernels.KernelFailed):
        kernel(
            torch.randn(1, 1, 514),
            torch.randn(2, 16, 1, 514),
            torch.randn(2, 16, 1, 514),
            torch.zeros(1, 1, dtype=torch.long),
            torch.tensor([3]),
            0.1,
        )
    assert kernels.is_disabled("decode_attention")
    assert dict(kernels.summary())["decode_attention"].endswith("(kernel failed)")
    # the model's layer recomputes that call with torch, and keeps to torch
    layer = attention_layer(9, 3, 64)
    layer.decode_kernel = kernel
    q, k_cache, v_cache = (
        torch.randn(2, 9, 64),
        torch.randn(4, 16, 3, 64),
        torch.randn(4, 16, 3, 64),
    )
    batch = ForwardBatch(
        positions=torch.tensor([19, 6]),
        slot_mapping=torch.tensor([19, 38]),
        decode_block_tables=torch.tensor([[0, 1], [2, 3]]),
        decode_context_lens=torch.tensor([20, 7]),
    )
    got = layer._decode_attention(q, k_cache, v_cache, batch)
    assert layer.decode_kernel is None
    torch.testing.assert_close(got, layer._decode_attention(q, k_cache, v_cache, batch))
    keys = k_cache[batch.decode_block_tables[1]].flatten(0, 1)[:7].repeat_interleave(3, 1)
    values = v_cache[batch.decode_block_tables[1]].flatten(0, 1)[:7].repeat_interleave(3, 1)
    scores = torch.einsum("hd,nhd->hn", q[1], keys) * layer.scale
    want = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).reshape(-1)
    torch.testing.assert_close(got[1], want, atol=1e-4, rtol=0)


PROMPT = "Rivers shaped where people settled, traded and fought. Write about rivers."


def test_a_kernel_that_kills_a_decode_worker_costs_one_migration_and_no_other_worker(
    harness, smollm_fp32, monkeypatch
):
    """Both decode workers load a build whose calls die by SIGSEGV (its self-check passes: the fault
    waits for run time). The first decode step kills the worker serving the request; the request
    migrates to the other, which has learnt on admitting it that the build killed a worker of its
    node and decodes with torch instead; the dead worker's replacement skips the build. One
    migration, one death, the output the single-process engine gives. Meanwhile every worker's
    fused-ops build crashes its self-check: each worker starts all the same, with torch's ops."""
    import engine.model
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    # the reference first, in this process, before the faults are set: torch's elementwise ops,
    # as the workers will run them
    with monkeypatch.context() as torch_ops:
        torch_ops.setattr(engine.model, "fused_ops_for", lambda x: None)
        reference = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20), loaded=smollm_fp32)
        prompt_ids = reference.tokenizer.encode(PROMPT)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        expected = reference.generate([prompt_ids], params)[0].token_ids
        del reference

    harness.ensure_ray()  # before the fault is set: only this system's workers may inherit it
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv(FAULT_ENV, f"decode_attention:runtime{tag},fused_ops:check{tag}")
    system = harness.start(transport="ray", num_prefill=1, num_decode=2)
    try:
        with system.client(timeout_s=120) as client:
            result = client.generate(
                client.request(token_ids=prompt_ids, max_tokens=24, temperature=0, ignore_eos=True)
            )
        assert list(result.token_ids) == expected
        router, pools = system.system.router, system.system.pools
        assert router.stats().migrations == 1
        deadline = time.monotonic() + 90  # the replacement starts and stays up
        while len(router.decode_pool.ready()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        stats = system.wait_idle()
        assert len(router.decode_pool.ready()) == 2, stats
        assert len(pools.replaced) == 1, pools.replaced
        assert all(w.kv_blocks_free == w.kv_blocks_total > 0 for w in stats.workers), stats
        kernels_by_worker = {w.worker_id: w.kernels for w in stats.workers}
        # the fused ops' crashing self-check: every worker runs torch's ops
        assert all("fused_ops torch" in k for k in kernels_by_worker.values()), kernels_by_worker
        # the survivor fell back to torch, the replacement took the next candidate
        first = _first_decode_variant()
        decode_kernels = [k for wid, k in kernels_by_worker.items() if wid.startswith("decode")]
        assert any("decode_attention torch" in k for k in decode_kernels), kernels_by_worker
        assert any(
            "decode_attention " in k and f"decode_attention {first}," not in k + ","
            for k in decode_kernels
        ), kernels_by_worker
    finally:
        system.stop()


@pytest.fixture(autouse=True, scope="module")
def _remove_faulting_builds():
    """The faulting libraries this module built (each run's own) leave the node's cache after it."""
    yield
    from engine.disk_cache import cache_root

    for flags in (cache_root() / "kernels").glob("*.so.flags"):
        if "PDSERVE_KERNEL_FAULT" in flags.read_text():
            library = flags.with_suffix("")
            for path in (library, flags, *library.parent.glob(library.name + ".*")):
                path.unlink(missing_ok=True)
