"""Two hosts on this machine, for people (root): two network namespaces joined by a shaped veth
link, a Ray cluster across them (head on A with `pdserve_prefill`, a node on B with
`pdserve_decode`) and, unless --no-serve, `pdserve serve` on A. tests/two_hosts.py does the work;
the tests use it too.

    sudo .venv/bin/python scripts/two_hosts.py [--rate 1gbit] [--transport grpc] [-- SERVE FLAGS]
    sudo .venv/bin/python scripts/two_hosts.py --sweep      # remove what crashed runs left

Then, on stdin: `shape RATE [DELAY_MS [JITTER_MS [LOSS_PCT]]]` (delay and loss need sch_netem),
`partition`, `heal`, `tc` (what is on the link), `quit` (or Ctrl-D / Ctrl-C). Everything is torn
down on the way out. Clients reach the router at the printed address, e.g.
`.venv/bin/pdserve chat --host <control> --port 50051 "Hello"`; `ip netns exec <namespace> ...`
runs anything on a host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.two_hosts import TwoHosts, TwoHostsError, sweep  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="the link's rate each way (tc units)")
    parser.add_argument("--transport", default="grpc", choices=["ray", "grpc", "rdt"])
    parser.add_argument("--no-serve", action="store_true", help="only the hosts and Ray")
    parser.add_argument("--sweep", action="store_true", help="clean up after crashed runs, exit")
    parser.add_argument("serve_flags", nargs="*", help="more `pdserve serve` flags, after --")
    args = parser.parse_args()
    if args.sweep:
        for removed in sweep():
            print("removed", removed)
        return 0
    try:
        with TwoHosts.create(rate=args.rate) as hosts:
            print(f"host A: {hosts.namespaces['a']} {hosts.a} (control {hosts.control})")
            print(f"host B: {hosts.namespaces['b']} {hosts.b}; link {args.rate}")
            cluster = hosts.start_ray()
            print(f"Ray: {cluster.address}; logs in {hosts.run_dir}")
            if not args.no_serve:
                server = hosts.serve(f"--transport={args.transport}", *args.serve_flags)
                print(f"pdserve: {server.host}:{server.port} ({args.transport})")
            _commands(hosts)
    except TwoHostsError as error:
        print(f"two_hosts: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _commands(hosts: TwoHosts) -> None:
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "shape" and len(words) >= 2:
                numbers = [float(word) for word in words[2:5]]
                print(hosts.link.shape(words[1], *numbers))
            elif words[0] == "partition":
                hosts.link.partition()
            elif words[0] == "heal":
                hosts.link.heal()
            elif words[0] == "tc":
                print(hosts.link.qdiscs())
            elif words[0] == "quit":
                return
            else:
                print("shape RATE [DELAY_MS [JITTER_MS [LOSS_PCT]]] | partition | heal | tc | quit")
        except (TwoHostsError, ValueError) as error:
            print(error)


if __name__ == "__main__":
    sys.exit(main())
