"""bf16 on CUDA: which part makes the engine's answers differ from HF transformers'. On a GPU
machine:

    python3 scripts/gpu_bf16_diagnosis.py [cuda|cpu]

Prints the engine's bf16 answers with CUDA graphs, eager, SDPA's math backend and the gather path
(same answers: no kernel is at fault), then, for the first prompt, how far each layer's hidden state
is from HF's in fp32 and in bf16, and both models' next token. Results: benchmarks/results/gpu/.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import engine.weights as weights  # noqa: E402
import gpu_engine  # noqa: E402
from engine.default_model import default_model_path  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model import ForwardBatch, PrefillSlice  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

TEXTS = ["What is the capital of France?", "List three prime numbers."]


def answers(device: str, label: str, **config) -> list[list[int]]:
    engine = LLMEngine(
        EngineConfig(dtype="bfloat16", device=device, kv_cache_bytes=256 << 20, **config)
    )
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in TEXTS]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    print(label, [engine.tokenizer.decode(o.token_ids) for o in outputs], flush=True)
    return prompts


def layer_differences(device: str, dtype: torch.dtype, ids: list[int]) -> None:
    name = str(dtype).removeprefix("torch.")
    engine = LLMEngine(
        EngineConfig(dtype=name, device=device, kv_cache_bytes=256 << 20, cuda_graphs=False)
    )
    hf = gpu_engine._hf_from_gguf(default_model_path(), dtype, device)
    model, states, n = engine.loaded.model, [], len(ids)
    hooks = [
        layer.register_forward_hook(lambda m, i, o: states.append(o.detach().float().clone()))
        for layer in model.layers
    ]
    blocks = torch.arange(4, 4 + -(-n // 16), device=device)  # any free blocks of a fresh engine
    batch = ForwardBatch(
        positions=torch.arange(n, device=device),
        slot_mapping=torch.arange(n, device=device) + 4 * 16,
        prefill_slices=[PrefillSlice(0, n, n, blocks)],
        logits_indices=torch.tensor([n - 1], device=device),
    )
    logits = model(
        torch.tensor(ids, device=device), batch, engine.kv_cache.k_caches, engine.kv_cache.v_caches
    )[0]
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        out = hf(torch.tensor([ids], device=device), output_hidden_states=True)
    # each layer's output; the last one is normed
    theirs = [h[0].float() for h in out.hidden_states][1:-1]
    for layer, (ours, reference) in enumerate(zip(states, theirs)):
        print(
            name,
            "layer",
            layer,
            "max abs diff",
            round((ours - reference).abs().max().item(), 4),
            "largest value",
            round(reference.abs().max().item(), 2),
        )
    hf_logits = out.logits[0, -1].float()
    print(
        name,
        "logits max abs diff",
        (logits - hf_logits).abs().max().item(),
        "next token ours / HF",
        logits.argmax().item(),
        hf_logits.argmax().item(),
        flush=True,
    )


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    prompts = answers(device, "graphs")
    answers(device, "eager", cuda_graphs=False)
    with sdpa_kernel([SDPBackend.MATH]):
        answers(device, "eager+math_sdpa", cuda_graphs=False)
    paged = weights.decode_kernel_for
    weights.decode_kernel_for = lambda device: None
    answers(device, "eager+gather_decode", cuda_graphs=False)
    weights.decode_kernel_for = paged
    for dtype in (torch.float32, torch.bfloat16):
        layer_differences(device, dtype, prompts[0])


if __name__ == "__main__":
    main()
