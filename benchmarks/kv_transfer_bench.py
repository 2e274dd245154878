"""KV handoff between two Ray actors, each transport, against memcpy measured in the same run.

    .venv/bin/python -m benchmarks.kv_transfer_bench [--repeats 3] [--prompts 1024,8192]
        [--transports ray,grpc,rdt] [--json out.json]

For each model shape (SmolLM2-135M: 30 layers x 3 kv heads x 64, 23,040 B/token in bf16; a
Llama-3-8B shape: 32 x 8 x 128, 131,072 B/token) and prompt length, a prefill actor and a decode
actor (one CPU and one torch thread each) hold paged caches of that shape, block size 16. One
handoff is timed in the driver, which plays the router: from asking the prefill actor to ship the
request's KV until the decode actor reports it ready (all layers installed and CRC-verified). For
`ray` the driver routes the ObjectRef-carrying delivery to the decode actor; for `rdt` it routes the
header-only delivery and the decode actor pulls the payload over Ray Direct Transport (gloo; the two
actors form a collective group first); for `grpc` the prefill actor streams straight to the decode
actor's server on 127.0.0.1. `memcpy` is one copy of the same bytes into a preallocated, warm buffer
inside the decode actor: the limit. Medians over the repeats, after one warm-up handoff.

"whole" ships all layers as one group; "in groups" ships groups of 6 layers back to back, so the
sender's export + CRC + send of one group overlaps the receiver's CRC + install of the previous one.
`--layerwise-ms-per-layer` adds a TTFT comparison: the prefill actor busy-computes each layer for
that long, and either ships all layers after the last one (whole) or each group of 6 layers as soon
as it is done (layerwise); the time from start to KV ready on the decode side is reported for both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read at import: keeps Ray on 127.0.0.1
# never-touched store pages are 3-10x slower
os.environ.setdefault("RAY_preallocate_plasma_memory", "1")

import ray  # noqa: E402
import torch  # noqa: E402

from engine.kv_cache import KVLayout  # noqa: E402
from kvtransfer.rdt_transport import actor_class_options, form_group  # noqa: E402
from tests.kv_ends import KVEndWorker  # noqa: E402

BLOCK_SIZE_TOKENS = 16
SHAPES = {
    "SmolLM2-135M": KVLayout(30, 3, 64, BLOCK_SIZE_TOKENS, "bfloat16"),
    "Llama-3-8B": KVLayout(32, 8, 128, BLOCK_SIZE_TOKENS, "bfloat16"),
}
LAYER_GROUP = 6


class BenchEnd(KVEndWorker):
    def allocate(self, num_blocks: int) -> list[int]:
        return self.end.allocator.allocate(num_blocks)  # keeps whatever (random) KV the blocks hold

    def memcpy_s(self, num_bytes: int, repeats: int) -> float:
        source = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
        target = torch.empty(num_bytes, dtype=torch.uint8).fill_(0)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def send_all(
        self, request_id, block_ids, destination, ms_per_layer: float = 0.0, layerwise: bool = False
    ):
        """Start a handoff and ship every layer (after simulated compute); yields ray deliveries as
        they are produced (a streaming generator, so the driver can route each one at once)."""
        self.side.start(request_id, block_ids, destination, lease_s=60.0)
        num_layers = self.end.cache.layout.num_layers
        group = LAYER_GROUP if layerwise else num_layers
        for start in range(0, num_layers, group):
            stop = min(start + group, num_layers)
            _busy(ms_per_layer * (stop - start if layerwise else num_layers) / 1000)
            delivery = self.side.send_layers(request_id, slice(start, stop))
            if delivery is not None:
                yield delivery

    def settle_sender(self, request_id: str, timeout_s: float = 60.0):
        # routed: the caller relays the ack
        if type(self.side).__name__ in ("RayKVSender", "RdtKVSender"):
            self.side.acknowledge(request_id)
            return "acknowledged", None
        return self.wait_settled(request_id, timeout_s)


def _busy(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    a = torch.ones(64, 64)
    while time.perf_counter() < deadline:
        a = a @ a * 1e-3


def one_handoff(
    prefill, decode, transport, block_ids, address, request_id, ms_per_layer=0.0, layerwise=False
):
    num_blocks = len(block_ids)
    ray.get(decode.reserve.remote(request_id, num_blocks, 60.0))
    started = time.perf_counter()
    pending = []
    for delivery_ref in prefill.send_all.options(num_returns="streaming").remote(
        request_id, block_ids, address, ms_per_layer, layerwise
    ):
        pending.append(decode.deliver.remote(ray.get(delivery_ref)))
    status, reserved = ray.get(decode.wait_settled.remote(request_id, 60.0))
    elapsed = time.perf_counter() - started
    assert status == "ready", (status, reserved, ray.get(pending))
    assert ray.get(prefill.settle_sender.remote(request_id))[0] == "acknowledged"
    ray.get(decode.free.remote(reserved))
    return elapsed


def bench_shape(name, layout, num_tokens, transports, repeats, ms_per_layer):
    num_blocks = -(-num_tokens // BLOCK_SIZE_TOKENS)
    num_bytes = num_blocks * layout.bytes_per_block
    rows = []
    for transport in transports:
        options = {"receive_buffer_bytes": num_bytes} if transport == "grpc" else {}
        worker = ray.remote(num_cpus=1, **(actor_class_options() if transport == "rdt" else {}))(
            BenchEnd
        )
        prefill = worker.remote(layout, num_blocks, transport, "sender")
        decode = worker.remote(layout, num_blocks, transport, "receiver", **options)
        try:
            if transport == "rdt":
                form_group([prefill], [decode], backend="gloo")
            address = ray.get(decode.address.remote())
            memcpy_s = ray.get(decode.memcpy_s.remote(num_bytes, repeats))
            ray.get(prefill.free.remote(ray.get(prefill.allocate_random.remote(num_blocks))))
            times, pipelined = [], []
            for index in range(repeats + 1):
                block_ids = ray.get(prefill.allocate.remote(num_blocks))
                times.append(
                    one_handoff(prefill, decode, transport, block_ids, address, f"r{index}")
                )
                block_ids = ray.get(prefill.allocate.remote(num_blocks))
                pipelined.append(
                    one_handoff(
                        prefill, decode, transport, block_ids, address, f"p{index}", layerwise=True
                    )
                )
            handoff_s = statistics.median(times[1:])
            pipelined_s = statistics.median(pipelined[1:])
            row = dict(
                shape=name,
                tokens=num_tokens,
                transport=transport,
                kv_bytes=num_bytes,
                handoff_ms=handoff_s * 1e3,
                gbps=num_bytes / handoff_s / 1e9,
                memcpy_ms=memcpy_s * 1e3,
                memcpy_gbps=num_bytes / memcpy_s / 1e9,
                samples_s=times[1:],
                pipelined_ms=pipelined_s * 1e3,
                pipelined_gbps=num_bytes / pipelined_s / 1e9,
                pipelined_samples_s=pipelined[1:],
            )
            if ms_per_layer:
                for mode in ("whole", "layerwise"):
                    samples = []
                    for index in range(repeats):
                        block_ids = ray.get(prefill.allocate.remote(num_blocks))
                        samples.append(
                            one_handoff(
                                prefill,
                                decode,
                                transport,
                                block_ids,
                                address,
                                f"{mode}{index}",
                                ms_per_layer,
                                mode == "layerwise",
                            )
                        )
                    row[f"ttft_{mode}_ms"] = statistics.median(samples) * 1e3
            rows.append(row)
            print(_format_row(row), flush=True)
        finally:
            ray.get([prefill.close.remote(), decode.close.remote()])
            ray.kill(prefill), ray.kill(decode)
    return rows


def _format_row(row) -> str:
    text = (
        f"| {row['shape']} | {row['tokens']} | {row['kv_bytes'] / 1e6:.1f} | {row['transport']} | "
        f"{row['handoff_ms']:.1f} | {row['gbps']:.2f} | {row['pipelined_ms']:.1f} | "
        f"{row['pipelined_gbps']:.2f} | {row['memcpy_ms']:.1f} | {row['memcpy_gbps']:.1f} | "
        f"{100 * row['pipelined_gbps'] / row['memcpy_gbps']:.0f}% |"
    )
    if "ttft_whole_ms" in row:
        text += f" {row['ttft_whole_ms']:.0f} / {row['ttft_layerwise_ms']:.0f} |"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", default="1024,8192")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--transports", default="ray,grpc,rdt")
    parser.add_argument("--layerwise-ms-per-layer", type=float, default=0.0)
    parser.add_argument("--object-store-gb", type=float, default=3.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=int(args.object_store_gb * (1 << 30)),
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
    )
    argv = [sys.executable.split("/")[-1], "-m", "benchmarks.kv_transfer_bench", *sys.argv[1:]]
    print(f"command: {shlex.join(argv)}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__} "
        f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), ray {ray.__version__}"
    )
    header = (
        "| shape | prompt tokens | KV MB | transport | whole: ms / handoff | GB/s | "
        f"in groups of {LAYER_GROUP} layers: ms | GB/s | memcpy ms | memcpy GB/s | best of memcpy |"
    )
    if args.layerwise_ms_per_layer:
        header += " KV ready after prefill start, whole / layerwise ms |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    try:
        for name in args.shapes.split(","):
            for tokens in map(int, args.prompts.split(",")):
                rows += bench_shape(
                    name,
                    SHAPES[name],
                    tokens,
                    args.transports.split(","),
                    args.repeats,
                    args.layerwise_ms_per_layer,
                )
    finally:
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
