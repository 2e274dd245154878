"""Counts the files and functions of this repository that one request runs through, in every process
(the router and each worker actor), for docs/architecture.md's journey (issue #18).

Every process of a local system gets a profiler (`sys.setprofile`, for all threads; in the workers
through Ray's `worker_process_setup_hook`) that notes, for each of our functions called, the 50 ms
ticks it was called in; a thread writes the notes to a file per process. The script starts a system,
warms it up, records an idle window and then a window holding exactly one request, and reports the
functions called during the request but not while idle (polls and heartbeats run either way: they
are counted apart).

    .venv/bin/python scripts/journey_count.py [--mode disaggregated|colocated]
        [--transport ray|grpc]
    cp scripts/journey_count.py OTHER/scripts/ && cd OTHER &&
        /this/.venv/bin/python scripts/journey_count.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import threading
import time

_DIR_ENV = "PDSERVE_JOURNEY_DIR"
_ROOT_ENV = "PDSERVE_JOURNEY_ROOT"
_TICK_S = 0.05


def install() -> None:
    """Starts noting calls of the repository's functions in this process (Ray's setup hook calls
    it)."""
    out, root = os.environ[_DIR_ENV], os.environ[_ROOT_ENV]
    ticks: dict[tuple[str, str], set[int]] = collections.defaultdict(set)

    def profile(frame, event, arg):
        if event == "call":
            filename = frame.f_code.co_filename
            if (
                filename.startswith(root)
                and "/.venv/" not in filename
                and "/tests/" not in filename
            ):
                ticks[(os.path.relpath(filename, root), frame.f_code.co_qualname)].add(
                    int(time.time() / _TICK_S)
                )

    def dump() -> None:
        path = os.path.join(out, f"{os.getpid()}.json")
        while True:
            time.sleep(0.2)
            snapshot = [[file, name, sorted(seen)] for (file, name), seen in list(ticks.items())]
            with open(path + ".tmp", "w") as f:
                json.dump(snapshot, f)
            os.replace(path + ".tmp", path)

    threading.setprofile(profile)
    sys.setprofile(profile)
    threading.Thread(target=dump, name="journey-dump", daemon=True).start()


def _called_in(out: str, start_s: float, stop_s: float) -> set[tuple[str, str]]:
    first, last = int(start_s / _TICK_S), int(stop_s / _TICK_S)
    called = set()
    for name in os.listdir(out):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                for file, function, seen in json.load(f):
                    if any(first <= tick <= last for tick in seen):
                        called.add((file, function))
    return called


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    parser.add_argument("--transport", default="grpc", choices=["ray", "grpc"])
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    out = tempfile.mkdtemp(prefix="journey-")
    import pdserve

    root = os.path.dirname(os.path.dirname(os.path.abspath(pdserve.__file__)))
    os.environ[_DIR_ENV], os.environ[_ROOT_ENV] = out, root
    import ray

    from pdserve.client import PdserveClient
    from pdserve.system import ServeConfig, new_event_loop, start_system

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
        # pickled by value: workers need not import this file
        runtime_env={
            "worker_process_setup_hook": install,
            "env_vars": {_DIR_ENV: out, _ROOT_ENV: root},
        },
    )
    install()
    loop = new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    wanted = dict(
        mode=args.mode,
        transport=args.transport,
        num_prefill=1,
        num_decode=1,
        port=0,
        kv_cache_bytes=64 << 20,
        dtype="float32",
        pd_policy="remote",
    )
    config = ServeConfig(
        **{k: v for k, v in wanted.items() if k in ServeConfig.__dataclass_fields__}
    )  # older trees too
    system = asyncio.run_coroutine_threadsafe(start_system(config), loop).result(timeout=300)
    prompt = "Rivers shaped where people settled, traded and fought. " * 20

    def one(text: str):
        with PdserveClient(port=system.port, timeout_s=120) as client:
            return client.generate(
                client.request(text, max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
            )

    for index in range(2):
        one(f"warm-up {index}. " + prompt)
    time.sleep(1.0)
    idle_start = time.time()
    time.sleep(3.0)
    idle_stop = time.time()
    time.sleep(3 * _TICK_S)  # no tick in both windows
    request_start = time.time()
    done = one("The request. " + prompt)
    request_stop = time.time()
    time.sleep(1.0)  # the dumps catch up
    idle = _called_in(out, idle_start, idle_stop)
    during = _called_in(out, request_start, request_stop)
    journey = sorted(
        (file, name)
        for file, name in during - idle
        # the client's side
        if not file.startswith(("pdserve/client.py", "pdserve_proto/", "scripts/"))
    )
    files = sorted({file for file, _ in journey})
    print(
        json.dumps(
            {
                "mode": args.mode,
                "transport": args.transport,
                "request_s": round(request_stop - request_start, 3),
                "tokens": len(done.token_ids),
                "files": len(files),
                "functions": len(journey),
                "serving_files": sum(not f.startswith("engine/") for f in files),
                "serving_functions": sum(not f.startswith("engine/") for f, _ in journey),
                "background_functions_also_called": len(during & idle),
                "by_file": {file: [name for f, name in journey if f == file] for file in files},
            },
            indent=1,
        )
    )
    asyncio.run_coroutine_threadsafe(system.stop(), loop).result(timeout=60)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
