"""1P on host A and 1D on host B over a shaped link (tests/two_hosts.py, as root), measured by
vLLM's own client as benchmarks/vs_vllm.sh measures one host: `vllm bench serve --backend
openai-chat`, random 512 in / 128 out, ignore-eos, Poisson arrivals, one seed per rate shared by
every system. A fresh system per (link, rate), warmed up with two requests first. Beside the
client's figures, each run keeps the server's KV handoffs from /metrics: their mean time and bytes,
and the link the router learnt.

    sudo .venv/bin/python -m benchmarks.two_hosts_bench VLLM_WORK OUT --links 10gbit,1gbit \
        --rates 0.5,1 --seeds 501,1001 [--prompts 32] [--transport grpc] [-- SERVE FLAGS]

VLLM_WORK: ../shared/anchors/vllm-cpu.sh's folder (its venv runs the client). The one-host
baselines come from benchmarks/vs_vllm.sh with the same seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.two_hosts import TwoHosts

ANCHOR = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "vllm-cpu.sh"
HTTP_PORT = 18000
_CLIENT_LINES = re.compile(
    r"Successful|Failed|Output token throughput|Request goodput|(Median|P99) (TTFT|TPOT|ITL)"
)


def _metric_sums(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram in Prometheus text."""
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(name + suffix + " "):
                values[suffix] = float(line.split()[-1])
    return values.get("_sum", 0.0), values.get("_count", 0.0)


def _bench(work: str, url: str, out: Path, rate: str, prompts: int, seed: int, slo: str) -> str:
    subprocess.run(
        ["bash", str(ANCHOR), "bench", work, url, "smollm2", str(out.with_suffix(".warmup.json"))]
        + ["inf", "2"],
        capture_output=True,
        timeout=600,
    )
    result = subprocess.run(
        ["bash", str(ANCHOR), "bench", work, url, "smollm2", str(out), rate, str(prompts)]
        + ["--goodput", *slo.split(), "--seed", str(seed)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out.with_suffix(".txt").write_text(result.stdout + result.stderr)
    return "\n".join(line for line in result.stdout.splitlines() if _CLIENT_LINES.search(line))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm_work")
    parser.add_argument("out")
    parser.add_argument("--links", default="10gbit,1gbit")
    parser.add_argument("--rates", default="0.5,1")
    parser.add_argument("--seeds", default="501,1001", help="one per rate")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--transport", default="grpc", choices=["ray", "grpc", "rdt"])
    parser.add_argument("--slo", default="ttft:1000 tpot:50")
    parser.add_argument("serve_flags", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    (out / "machine.json").write_text(
        json.dumps({"torch_cpu_capability": torch.backends.cpu.get_cpu_capability()})
    )
    seeds = dict(zip(args.rates.split(","), (int(s) for s in args.seeds.split(","))))
    for link in args.links.split(","):
        for rate, seed in seeds.items():
            name = f"two-hosts-{link}-{rate}"
            with TwoHosts.create(rate=link) as hosts:
                hosts.start_ray()
                server = hosts.serve(
                    f"--transport={args.transport}",
                    f"--http-port={HTTP_PORT}",
                    "--served-model-name=smollm2",
                    "--prefill=1",
                    "--decode=1",
                    *args.serve_flags,
                )
                url = f"http://{server.host}:{HTTP_PORT}"
                summary = _bench(
                    args.vllm_work, url, out / f"{name}.json", rate, args.prompts, seed, args.slo
                )
                with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                    metrics = response.read().decode()
                (out / f"{name}.metrics.txt").write_text(metrics)
                server.stop()
            seconds, count = _metric_sums(metrics, "pdserve_kv_transfer_seconds")
            kv_bytes, _ = _metric_sums(metrics, "pdserve_kv_transfer_bytes")
            handoff = (
                f"KV handoffs {count:.0f}, mean {seconds / count * 1e3:.1f} ms, "
                f"{kv_bytes / count / 1e6:.2f} MB"
                if count
                else "no KV handoff"
            )
            print(f"== {name} (seed {seed})\n{summary}\n{handoff}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
