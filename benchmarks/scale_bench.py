"""Scaling under load: seconds from a scale-up command to the new decode worker serving its first
request, and failed requests across a scale-down under load.

    .venv/bin/python -m benchmarks.scale_bench [--threads 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

# before anything imports ray: keep it on loopback
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from tests.serving_harness import Harness
from tests.test_scaling import SteadyLoad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--threads", type=int, default=3, help="client threads sending back-to-back requests"
    )
    args = parser.parse_args()
    harness = Harness()
    system = harness.start(transport="ray")
    load = SteadyLoad(system, threads=args.threads)
    try:
        time.sleep(3)
        started = time.monotonic()
        with system.client() as client:
            client.scale(decode=2)
        returned_s = time.monotonic() - started
        served_before = len(load.completions)
        while not any(c.decode_worker == "decode-1" for c in load.completions[served_before:]):
            time.sleep(0.05)
        first_served_s = time.monotonic() - started
        completions_before_down = len(load.completions)
        with system.client() as client:
            client.scale(decode=1)
        while len([w for w in system.stats().workers if w.role == "decode"]) > 1:
            time.sleep(0.1)
        time.sleep(2)
    finally:
        load.stop()
        system.stop()
        harness.close()
    print(
        json.dumps(
            {
                "scale_up_call_returned_s": round(returned_s, 2),
                "scale_up_to_first_request_served_s": round(first_served_s, 2),
                "requests_during_scale_down": len(load.completions) - completions_before_down,
                "failed_requests": len(load.errors),
                "requests_total": len(load.completions),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
