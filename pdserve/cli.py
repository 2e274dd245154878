"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from pdserve import node_supervisor


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="run the engine in this process and stream the generated text to stdout"
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--model",
        default="default",
        help="'default', a .gguf file, an HF model directory, or dummy:<shape>",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bf16 where the CPU has native bf16 (AVX512-BF16/AMX) or on CUDA, else fp32",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the engine runs; auto: cuda where torch sees a GPU, else cpu",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly (no CUDA graphs)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template to the prompt as one user turn",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: the CPUs this process may use, runtime/cpus.py)",
    )
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    from engine.dtypes import resolve_device
    from runtime.cpus import usable_cpus

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=resolve_device(args.device),
            cuda_graphs=not args.enforce_eager,
            num_threads=args.threads or usable_cpus(),
        )
    )
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


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start (or join) a Ray cluster, the worker pools and the router; serve until "
        "interrupted",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated mode)")
    p.add_argument(
        "--decode", type=int, default=1, help="decode workers (colocated: workers doing both)"
    )
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    p.add_argument(
        "--transport",
        default="ray",
        choices=["ray", "grpc", "rdt"],
        help="how KV moves between workers (rdt: Ray Direct Transport; its workers are fixed "
        "at start)",
    )
    p.add_argument("--model", default="default")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bf16 where the CPU has native bf16 (AVX512-BF16/AMX) or on CUDA, else fp32",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where workers run (cuda: each asks Ray for one GPU); auto: cuda where the "
        "cluster has GPUs, else cpu",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly (no CUDA graphs)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels (CPU, bf16 with AVX512_BF16 or fp32 with AVX2): greedy "
        "output identical whatever the batch, a migration or where a prompt prefills; slower",
    )
    p.add_argument(
        "--address",
        default="local",
        help="'local' starts Ray here; 'auto' or host:port joins a cluster",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--kv-host",
        default="auto",
        help="address decode workers bind for their token stream to the router and "
        "their gRPC KV receiver; auto: 127.0.0.1 on a local node, each worker's node address on a "
        "cluster",
    )
    from router.kv_wire import KV_WIRE_CHOICES  # torch-free

    p.add_argument(
        "--kv-wire",
        default="auto",
        choices=KV_WIRE_CHOICES,
        help="how a request's KV goes on the wire: none (the cache's bytes), lossless (byte "
        "shuffle + zstd), fp8 or int8 (a scale per block and head; lossy, with --kv-wire-lossy "
        "ok); auto: per request, the mode that delivers it sooner over the measured link",
    )
    p.add_argument(
        "--kv-wire-lossy",
        default="no",
        choices=["no", "ok"],
        help="ok: --kv-wire may use the lossy modes fp8 and int8 (auto among them)",
    )
    p.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="CPUs per worker (default: on a local node, its cores / max(4, workers), workers "
        "sharing cores with one thread each; on a cluster 1); a worker computes with its whole "
        "CPUs as threads",
    )
    p.add_argument(
        "--worker-start-timeout-s",
        type=float,
        default=300.0,
        help="give up on new workers not ready by then (no room on the cluster?)",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="KV cache per worker (default: a tenth of the node's available memory, at most 4 GiB)",
    )
    p.add_argument(
        "--pd-policy",
        default="auto",
        choices=["auto", "remote", "local"],
        help="where a disaggregated request prefills: remote (the prefill pool), local (its "
        "decode worker, interleaved with decoding), auto (local for short prompts or when the "
        "prefill queue is longer)",
    )
    p.add_argument(
        "--prefill-order",
        default="slo",
        choices=["slo", "fcfs"],
        help="the prefill queue's order: slo (earliest TTFT deadline first among the prompts that "
        "can still meet the SLO's TTFT, the late ones after them), fcfs (first come, first served)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=256,
        help="auto: prompts with at most this many tokens not cached on the decode worker "
        "prefill there",
    )
    p.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "load"],
        help="which worker of a pool takes a request: prefix (weighs the prompt prefix each "
        "worker's KV cache holds, from its KV events, against its load) or load (load alone; "
        "whole prompts shipped)",
    )
    p.add_argument(
        "--prefix-weight",
        type=float,
        default=1.0,
        help="prefix routing: one cached prompt token offsets this many prompt tokens of queue",
    )
    p.add_argument(
        "--decode-stream-tokens",
        type=int,
        default=64,
        help="prefix routing: a decode worker's running request weighs like this many queued "
        "prompt tokens",
    )
    p.add_argument(
        "--lend-cores",
        default="all",
        choices=["all", "prefill", "off"],
        help="which engine steps may borrow the cores of a worker on the same node that has "
        "nothing to compute: all, prefill (only steps computing prompt tokens), off",
    )
    p.add_argument(
        "--decode-interleave-tokens",
        type=int,
        default=256,
        help="prompt tokens a decode/colocated worker prefills between two decode steps (0: "
        "prefill first)",
    )
    p.add_argument(
        "--cpu-prefill-batch-tokens",
        type=int,
        default=256,
        help="on a CPU, prompts share a prefill step only up to this many tokens in all; a longer "
        "prompt prefills alone, first come first served (0: every waiting prompt the token budget "
        "holds, as on a GPU)",
    )
    p.add_argument(
        "--autoscale",
        nargs="?",
        const="reactive",
        default=None,
        choices=["reactive", "plan"],
        help="grow/shrink each pool from queue time, TTFT and KV use; plan: steer the pools to the "
        "sizes of --autoscale-plan for the arrival rate, growing past them only under pressure",
    )
    p.add_argument(
        "--autoscale-plan",
        default=None,
        metavar="FILE",
        help="with --autoscale plan: `pdserve plan --json` output (one plan, or a JSON list of "
        "plans for several rates)",
    )
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=4)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=4)
    p.add_argument("--autoscale-cooldown-s", type=float, default=30.0)
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (and /metrics) on this port",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the HTTP API (default: the model file's name)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="whose tokenizer and chat template to use, as a model spec (default: the model's own; "
        "a dummy: model needs one, e.g. default)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a chat template replacing the tokenizer's: a file's path or the template itself",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a data-plane API key (repeatable; default: $PDSERVE_API_KEY, comma-separated)",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help="the token for admin calls such as Scale (default: $PDSERVE_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving beyond 127.0.0.1 without an API key and admin token",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        help="PEM certificate: TLS for the gRPC and HTTP servers (with --tls-key)",
    )
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=1024,
        help="requests held at once; beyond: RESOURCE_EXHAUSTED / HTTP 429",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests queued for decode KV room; beyond: RESOURCE_EXHAUSTED / HTTP 429",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="decode tokens per streamed message: 1 sends every token at once; N cuts the router's "
        "messages N-fold, in bursts of N tokens",
    )
    from router.slo import DEFAULT_SLO, FAST_SLO, FP32_CPU_SLO  # torch-free

    p.add_argument(
        "--slo",
        default=DEFAULT_SLO,
        metavar="ttft:MS,tpot:MS",
        help="latency targets, in ms as vLLM's --goodput takes them: completed requests are judged "
        "against them (pdserve_slo_* metrics, pdserve status) and decoding workers lend their "
        f"cores to prefills within the TPOT target; default {DEFAULT_SLO}: {FAST_SLO} where "
        f"workers serve bf16, {FP32_CPU_SLO} for fp32 on CPUs",
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="log lines as text or JSON lines (both carry the request id)",
    )
    p.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no line per HTTP request and gRPC call (method, path, status, latency, request and "
        "trace ids) on the pdserve.access logger",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="export a trace per request by OTLP/gRPC to this collector (pip install "
        "'pdserve[otel]'); default: no tracing",
    )
    p.set_defaults(handler=_serve)


def _serve_config(args: argparse.Namespace, **overrides):
    from pdserve.system import ServeConfig

    fields = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        enforce_eager=args.enforce_eager,
        deterministic=args.deterministic,
        mode=args.mode,
        transport=args.transport,
        num_prefill=args.prefill,
        num_decode=args.decode,
        cpus_per_worker=args.cpus_per_worker,
        worker_start_timeout_s=args.worker_start_timeout_s,
        address=args.address,
        host=args.host,
        port=args.port,
        kv_host=args.kv_host,
        kv_cache_bytes=None if args.kv_cache_mib is None else args.kv_cache_mib << 20,
        pd_policy=args.pd_policy,
        kv_wire=args.kv_wire,
        kv_wire_lossy=args.kv_wire_lossy == "ok",
        prefill_order=args.prefill_order,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        routing=args.routing,
        prefix_weight=args.prefix_weight,
        decode_stream_tokens=args.decode_stream_tokens,
        decode_interleave_tokens=args.decode_interleave_tokens or None,
        cpu_prefill_batch_tokens=args.cpu_prefill_batch_tokens or None,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        api_keys=_api_keys(args.api_key),
        admin_token=args.admin_token or os.environ.get("PDSERVE_ADMIN_TOKEN") or None,
        insecure=args.insecure,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_in_flight=args.max_in_flight,
        max_waiting_for_kv=args.max_waiting,
        stream_interval=args.stream_interval,
        lend_cores=args.lend_cores,
        slo=args.slo,
        access_log=args.access_log,
        otlp_endpoint=args.otlp_endpoint,
    )
    if (args.autoscale == "plan") != (args.autoscale_plan is not None):
        raise ValueError("--autoscale plan and --autoscale-plan FILE go together")
    if args.autoscale:
        from router.pools import AutoscaleConfig, PlanTarget

        plan = PlanTarget.load(args.autoscale_plan) if args.autoscale == "plan" else None
        if plan is not None and plan.mode != args.mode:
            raise ValueError(
                f"--autoscale-plan plans a {plan.mode} system; this one is --mode {args.mode}"
            )
        if plan is not None and args.cpus_per_worker is not None:
            planned = {size.cpus_per_worker for size in plan.sizes}
            if planned != {args.cpus_per_worker}:
                raise ValueError(
                    "--autoscale-plan sizes workers of "
                    f"{'/'.join(f'{c:g}' for c in sorted(planned))} "
                    f"CPUs; this system's are --cpus-per-worker {args.cpus_per_worker:g}"
                )
        fields["autoscale"] = AutoscaleConfig(
            min_prefill=args.min_prefill,
            max_prefill=args.max_prefill,
            min_decode=args.min_decode,
            max_decode=args.max_decode,
            cooldown_s=args.autoscale_cooldown_s,
            plan=plan,
        )
    fields.update(overrides)
    return ServeConfig(**fields)


def _api_keys(given: Optional[list[str]]) -> tuple[str, ...]:
    keys = given if given else os.environ.get("PDSERVE_API_KEY", "").split(",")
    return tuple(key.strip() for key in keys if key.strip())


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from pdserve.system import PortInUseError, run_router_loop, start_system
    from router.logs import configure_logging

    configure_logging("INFO", json_lines=args.log_format == "json")
    config = _serve_config(args)  # bad flags fail here, before Ray starts

    async def run() -> None:
        system = await start_system(config)  # logs the ready line
        print("pdserve: Ctrl-C stops", file=sys.stderr, flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        print("pdserve: shutting down", file=sys.stderr, flush=True)
        await system.stop()

    try:
        run_router_loop(run())
    except PortInUseError as error:
        print(f"pdserve serve: error: {error}", file=sys.stderr)
        return 1
    return 0


def _add_client_args(p: argparse.ArgumentParser, admin: bool = False) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--tls-ca", default=None, help="PEM root certificate: connect with TLS")
    if admin:
        p.add_argument("--admin-token", default=None, help="default: $PDSERVE_ADMIN_TOKEN")
    else:
        p.add_argument("--api-key", default=None, help="default: $PDSERVE_API_KEY (its first key)")


def _client(args: argparse.Namespace):
    from pdserve.client import PdserveClient

    if hasattr(args, "admin_token"):
        token = args.admin_token or os.environ.get("PDSERVE_ADMIN_TOKEN")
    else:
        token = args.api_key or next(iter(_api_keys(None)), None)
    return PdserveClient(args.host, args.port, api_key=token, tls_ca=args.tls_ca)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="send a prompt as one chat user turn to a running server; stream the answer"
    )
    p.add_argument("prompt")
    _add_client_args(p)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.set_defaults(handler=_chat)


def _chat(args: argparse.Namespace) -> int:
    import grpc

    with _client(args) as client:
        request = client.request(
            messages=[{"role": "user", "content": args.prompt}],
            temperature=args.temperature,
            max_tokens=args.max_tokens,
        )
        try:
            for response in client.stream(request):
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as error:
            print(f"\npdserve chat: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="exit 0 once a server is ready to serve; print its pools")
    _add_client_args(p)
    p.add_argument(
        "--json", action="store_true", help="one JSON object (workers: role, node, state, ...)"
    )
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for readiness")
    p.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    import json

    from google.protobuf.json_format import MessageToDict

    with _client(args) as client:
        if not client.wait_ready(args.wait) and not client.is_serving():
            print(f"pdserve status: no server ready at {args.host}:{args.port}", file=sys.stderr)
            return 1
        stats = client.stats()
    if args.json:
        print(
            json.dumps(
                MessageToDict(
                    stats,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
            )
        )
        return 0
    print(
        f"{stats.mode}, {stats.transport} transport, model {stats.model}: "
        f"{stats.requests_in_flight} in flight, {stats.requests_waiting_for_kv} waiting for KV "
        f"room, {stats.requests_completed} completed, {stats.requests_failed} failed; recent TTFT "
        f"p50 {stats.recent_ttft_p50_s * 1e3:.0f} ms, TPOT p50 "
        f"{stats.recent_tpot_p50_s * 1e3:.1f} ms; context {stats.max_context_tokens} tokens "
        f"(model {stats.model_context_tokens})"
    )
    if stats.slo:
        attainment = f" ({stats.slo_met / stats.slo_finished:.1%})" if stats.slo_finished else ""
        print(
            f"  SLO {stats.slo}: {stats.slo_met} of {stats.slo_finished} completed requests met "
            f"it{attainment}"
        )
    for w in stats.workers:
        print(
            f"  {w.worker_id:<14} {w.role:<10} {w.state:<8} node {w.node}  {w.cpus:g} CPU, "
            f"{w.threads} thread(s)  running {w.running_requests}  waiting {w.waiting_requests}  "
            f"KV free {w.kv_blocks_free}/{w.kv_blocks_total} ({w.kv_capacity_tokens} tokens)  "
            f"served {w.requests_served}"
        )
        if w.kernels:
            print(f"  {'':<14} kernels: {w.kernels}")
    for link in stats.links:
        print(
            f"  link {link.sender_node} -> {link.receiver_node}: "
            f"{link.bandwidth_bytes_per_s * 8 / 1e9:.2f} Gbit/s, latency "
            f"{link.latency_s * 1e3:.2f} ms ({link.handoffs} KV handoffs; the last "
            f"{link.last_bytes} B in {link.last_s * 1e3:.1f} ms)"
        )
    for line in stats.degraded:
        print(f"  degraded: {line}")
    for line in stats.autoscaler_decisions:
        print(f"  autoscaler: {line}")
    return 0


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale", help="resize a running server's pools; returns when the new sizes are in effect"
    )
    _add_client_args(p, admin=True)
    p.add_argument("--prefill", type=int, default=None)
    p.add_argument("--decode", type=int, default=None)
    p.set_defaults(handler=_scale)


def _scale(args: argparse.Namespace) -> int:
    import grpc

    with _client(args) as client:
        try:
            reply = client.scale(args.prefill, args.decode)
        except grpc.RpcError as error:
            print(f"pdserve scale: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    print(f"ready: {reply.prefill} prefill, {reply.decode} decode")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="start a local 1 prefill + 1 decode system, send a few chat prompts, stop"
    )
    p.add_argument("--transport", default="ray", choices=["ray", "grpc", "rdt"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bf16 where the CPU has native bf16 (AVX512-BF16/AMX) or on CUDA, else fp32",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where workers run (cuda: each asks Ray for one GPU); auto: cuda where this node "
        "has GPUs, else cpu",
    )
    p.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from pdserve.demo import run_demo

    return run_demo(args.transport, args.dtype, args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from pdserve.bench import add_parser as _add_bench
    from pdserve.planner.commands import add_parsers as _add_planner  # profile, simulate, plan

    for add in (
        _add_generate,
        _add_serve,
        _add_chat,
        _add_status,
        _add_scale,
        _add_demo,
        _add_bench,
        _add_planner,
        node_supervisor.add_parser,
    ):
        add(sub)
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
