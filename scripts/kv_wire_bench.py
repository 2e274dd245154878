"""Each KV wire codec (kvtransfer/codecs.py) on a prompt's real KV: the default model prefills a
512-token prompt (this repo's README as a chat message), and each mode encodes and decodes the
exported KV on one thread. Prints the wire's size over the raw KV's and MB/s (of raw KV) each way,
the numbers protocol/kv_wire.py's CODEC_COSTS holds.

    .venv/bin/python scripts/kv_wire_bench.py [--dtype float32 bfloat16] [--tokens 512]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def real_kv(dtype: str, tokens: int) -> torch.Tensor:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_bytes=64 << 20, num_threads=1))
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()[: tokens * 8]
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": text}])[:tokens]
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("bench", prompt, params, hand_off_after_prefill=True)
    engine.step()
    return engine.export_kv("bench").clone()


def best_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    from engine.kv_cache import KVLayout
    from kvtransfer import codecs
    from protocol.kv_wire import WIRE_MODES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    for dtype in args.dtype:
        kv = real_kv(dtype, args.tokens)
        layers, _, blocks, block_tokens, heads, head_dim = kv.shape
        layout = KVLayout(layers, heads, head_dim, block_tokens, dtype)
        raw_mb = kv.numel() * kv.element_size() / 1e6
        for mode in WIRE_MODES[1:]:
            codec = codecs.codec(mode)
            wire = codec.encode(kv)
            encode_s = best_s(lambda: codec.encode(kv), args.repeats)
            decode_s = best_s(lambda: codec.decode(wire, layout, layers, blocks), args.repeats)
            decoded = codec.decode(wire, layout, layers, blocks)
            error = (decoded.float() - kv.float()).abs().max().item()
            print(
                f"{dtype:9} {mode:9} {raw_mb:6.1f} MB  wire/raw {wire.numel() / raw_mb / 1e6:.3f}"
                f"  encode {raw_mb / encode_s:6.0f} MB/s  decode {raw_mb / decode_s:6.0f} MB/s"
                f"  max |error| {error:.3g}"
            )


if __name__ == "__main__":
    main()
