"""The planner's subcommands of `pdserve`: profile, simulate, plan (pdserve/cli.py adds them)."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_WORKLOAD = "in=512,out=128,n=200"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="measure this machine's prefill, decode, KV handoff and router costs (JSON)"
    )
    p.add_argument("--out", default="profile.json")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few points in seconds, no Ray (tests): the handoff's in-process floor",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--transports", default="ray", help="comma-separated KV transports to time (ray, grpc)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs per point, after a warm-up (default 3; --quick 1)",
    )
    p.add_argument(
        "--serving",
        default="on",
        choices=["on", "off", "only"],
        help="also fit the serving path's costs on a running "
        "`pdserve serve --prefill 1 --decode 1` "
        "(a minute or two; --quick: off); only: add them to the profile already at --out",
    )
    p.set_defaults(handler=_profile)

    p = sub.add_parser(
        "simulate", help="predict TTFT/TPOT/ITL, goodput and utilisation of a system from a profile"
    )
    _add_common(p)
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument(
        "--shape", default="1p1d@1", help="1p1d, 2p2d@0.5 (CPUs per worker), colo2, 2p1d@1/remote"
    )
    p.add_argument(
        "--decode-interleave-tokens",
        type=int,
        default=256,
        help="0: prefill first, as the serve flag",
    )
    p.set_defaults(handler=_simulate)

    p = sub.add_parser(
        "plan",
        help="the cheapest system meeting an SLO at a rate, or the highest rate a size holds",
    )
    _add_common(p)
    p.add_argument("--rate", type=float, default=None, help="requests per second to plan for")
    p.add_argument(
        "--max-rate", action="store_true", help="instead: the highest rate --cluster-cpus holds"
    )
    p.add_argument(
        "--cluster-cpus",
        type=float,
        default=None,
        help="with --max-rate: the CPUs the workers may take",
    )
    p.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="share of requests within the SLO to count as meeting it",
    )
    p.add_argument(
        "--shapes",
        default=None,
        help="instead of searching: the best of these shapes at --rate (comma-separated, e.g. "
        "1p1d@0.5,colo2@0.5,2p2d@0.5: alternatives for the same machine), by predicted goodput",
    )
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--cpus-per-worker", default="0.5,1,2", help="comma-separated choices")
    p.set_defaults(handler=_plan)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="a JSON file written by `pdserve profile`")
    p.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        help="in=N[-M],out=N[-M],n=N,arrival=poisson|fixed,multi=SHARE,turn=N,seed=N "
        f"(default {DEFAULT_WORKLOAD})",
    )
    p.add_argument(
        "--slo",
        default="auto",
        metavar="ttft:MS,tpot:MS",
        help="as `pdserve serve --slo`; auto: by the profile's dtype (router/slo.py)",
    )
    p.add_argument(
        "--transport",
        default="ray",
        help="the KV transport, as profiled (--quick profiles: inproc)",
    )
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE[,RTT]",
        help="the prefill and decode pools on two hosts over this link, e.g. 1gbit,0.5ms "
        "(default: one host, as profiled)",
    )
    p.add_argument(
        "--node-cores",
        type=int,
        default=None,
        help="cores per node (default: the profiled machine's)",
    )
    p.add_argument(
        "--no-lend-cores",
        action="store_true",
        help="as `pdserve serve --lend-cores off` (and for GPU profiles: a worker is one device)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="the engine's token budget per step (the GPU check ran 8192)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _profile(args: argparse.Namespace) -> int:
    import dataclasses

    from pdserve.planner.profile import Profile
    from pdserve.planner.profiler import ProfileGrid, measure

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.serving == "only":
        profile = Profile.load(args.out)
    else:
        grid = (
            ProfileGrid.quick()
            if args.quick
            else ProfileGrid(transports=tuple(args.transports.split(",")))
        )
        if args.repeats is not None:
            grid = dataclasses.replace(grid, repeats=args.repeats)
        profile = measure(grid, args.dtype, log=log)
        profile.save(args.out)  # kept if the serving probe fails
    if args.serving == "only" or (args.serving == "on" and not args.quick):
        from pdserve.planner.serving_probe import measure_serving

        serving = measure_serving(profile, log=log)
        log(
            f"engine steps as served: prefill {serving.prefill_share:+.1%}, decode "
            f"{serving.decode_share:+.1%}; serving path: {serving.request_s * 1e3:.1f} ms per "
            f"request, a decode step "
            f"+{serving.step_s * 1e3:.2f} ms + {serving.token_s * 1e3:.2f} ms per token; "
            f"on borrowed cores a prefill step +{serving.borrow_prefill_share:.1%} of its engine "
            f"time, a decode step +{serving.borrow_decode_s * 1e3:.1f} ms"
        )
        profile = profile.with_serving(serving)
    profile.save(args.out)
    print(
        f"wrote {args.out}: {profile.machine['cpu_model']}, {profile.machine['cpu_capability']}, "
        f"{profile.machine['dtype']}, {profile.cores} cores",
        file=sys.stderr,
    )
    return 0


def _inputs(args: argparse.Namespace):
    from pdserve.planner.profile import Profile
    from pdserve.planner.workload import Workload
    from router.slo import SLO

    profile = Profile.load(args.profile)
    slo = SLO.resolve(args.slo, profile.machine.get("dtype", "auto"), "cpu")
    return profile, Workload.parse(args.workload), slo


def _simulate(args: argparse.Namespace) -> int:
    from pdserve.planner.shape import Link, SystemShape
    from pdserve.planner.simulator import simulate

    profile, workload, slo = _inputs(args)
    profile.handoff_s(1, args.transport)  # a transport the profile lacks: one clear error
    shape = SystemShape.parse(
        args.shape,
        transport=args.transport,
        link=Link.parse(args.link) if args.link else None,
        lend_cores=not args.no_lend_cores,
        decode_interleave_tokens=args.decode_interleave_tokens or None,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    report = simulate(profile, shape, slo, workload.requests(args.rate), args.node_cores)
    if args.json:
        print(json.dumps({"slo": str(slo), "rate_rps": args.rate, **report.to_json()}))
    else:
        print(f"SLO {slo}, {args.rate:g} req/s, workload {args.workload}")
        print(report.table())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pdserve.planner.search import SearchSpace, best_of, cheapest, highest_rate
    from pdserve.planner.shape import Link, SystemShape

    profile, workload, slo = _inputs(args)
    space = SearchSpace(
        max_workers=args.max_workers,
        cpus_per_worker=tuple(float(c) for c in args.cpus_per_worker.split(",")),
        transport=args.transport,
        lend_cores=not args.no_lend_cores,
        max_num_batched_tokens=args.max_num_batched_tokens,
        link=Link.parse(args.link) if args.link else None,
    )
    # a transport the profile lacks: one clear error before searching
    profile.handoff_s(1, args.transport)
    log = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if not args.json
        else (lambda line: None)
    )
    if args.max_rate:
        if args.cluster_cpus is None:
            raise ValueError("--max-rate needs --cluster-cpus")
        plan = highest_rate(
            profile,
            workload,
            slo,
            args.cluster_cpus,
            space,
            args.attainment,
            args.node_cores,
            log=log,
        )
    elif args.shapes:
        if args.rate is None:
            raise ValueError("--shapes needs --rate")
        settings = dict(
            transport=args.transport,
            lend_cores=not args.no_lend_cores,
            max_num_batched_tokens=args.max_num_batched_tokens,
            link=space.link,
        )
        shapes = [SystemShape.parse(text, **settings) for text in args.shapes.split(",")]
        plan = best_of(profile, workload, slo, args.rate, shapes, args.node_cores, log=log)
    else:
        if args.rate is None:
            raise ValueError("plan needs --rate (or --max-rate --cluster-cpus N)")
        plan = cheapest(
            profile, workload, slo, args.rate, space, args.attainment, args.node_cores, log=log
        )
    # --shapes picks the best of them by goodput even where none holds the SLO (past every one's
    # capacity), or where the pick does not and another does (goodput divides by each run's end)
    meets = plan.report is not None and plan.report.slo_attainment >= args.attainment
    any_meets = any(t.get("slo_attainment", 0.0) >= args.attainment for t in plan.tried)
    if args.json:
        print(
            json.dumps(
                {
                    "slo": str(slo),
                    "attainment_target": args.attainment,
                    "meets_attainment_target": meets,
                    **plan.to_json(),
                }
            )
        )
    elif plan.shape is None:
        print(
            f"nothing within the search space meets {slo} for {args.attainment:.0%} of requests"
            + (f" at {plan.rate_rps:g} req/s" if not args.max_rate else "")
        )
    else:
        print(
            f"plan: {plan.shape} ({plan.shape.total_cpus:g} CPUs) at {plan.rate_rps:.2f} req/s: "
            f"pdserve serve {plan.shape.serve_flags()} --slo {slo}"
        )
        if not meets:
            print(
                f"(the highest goodput of the shapes, but it meets {slo} for "
                f"{plan.report.slo_attainment:.1%} of requests, not {args.attainment:.0%}; "
                + ("another shape does: see --json's tried)" if any_meets else "none does)")
            )
        print(plan.report.table())
    return 0 if meets or any_meets else 1
