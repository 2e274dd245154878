"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run the engine in this process and stream the generated text to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default="default", help="'default', a .gguf file, an HF model directory, or dummy:<shape>")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt as one user turn")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads or os.cpu_count()))
    if engine.tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer, so it cannot take a text prompt")
    prompt = args.prompt
    if args.chat:
        prompt_ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        prompt_ids = engine.tokenizer.encode(prompt)
    engine.add_request("cli", prompt_ids, params)
    for output in engine.run_until_done():
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:  # bad input: one clear line, no traceback
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
