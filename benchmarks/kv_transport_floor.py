"""The floors under the KV handoff's targets (issue #3): what each transport's own mechanism costs with
no KV work around it, against memcpy measured in the same run.

    .venv/bin/python -m benchmarks.kv_transport_floor [--mib 24,189] [--repeats 9]

- memcpy: one copy into a preallocated, warm buffer (numpy `copyto`), inside a Ray actor;
- `ray.put`: the same bytes put into the object store by that actor (plasma preallocated, warm: the
  object of the previous repeat freed first). The ray transport's sender cannot do less than this;
- `ray.get`: another actor maps the object (zero-copy) and reads one byte per page;
- gRPC: a bare Python gRPC client stream of prebuilt 1 and 2 MiB `bytes` chunks (identity
  serializers) to a server in another process that only counts them; the grpc transport's floor.
Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from concurrent import futures

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read at import: keeps Ray on 127.0.0.1
os.environ.setdefault("RAY_preallocate_plasma_memory", "1")

import numpy as np  # noqa: E402
import ray  # noqa: E402

_SERVICE = "floor.Bulk"


class Sender:
    def run(self, num_bytes: int, repeats: int) -> dict:
        source = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
        target = np.empty_like(source)
        copies, puts, self.refs = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            np.copyto(target, source)
            copies.append(time.perf_counter() - started)
            self.refs.clear()  # the previous object's memory goes back to the store first
            started = time.perf_counter()
            self.refs.append(ray.put(source))
            puts.append(time.perf_counter() - started)
        return {"memcpy_s": statistics.median(copies), "put_s": statistics.median(puts)}

    def ref(self) -> list:
        return list(self.refs)  # inside a list: the receiver gets the ref, not the value


class Receiver:
    def get(self, refs: list, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            array = ray.get(refs[0])
            int(array[::4096].sum())  # touch every page
            times.append(time.perf_counter() - started)
            del array
        return statistics.median(times)


def _serve(ports: "multiprocessing.Queue") -> None:
    import grpc

    def push(frames, context):
        return sum(len(frame) for frame in frames).to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        _SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(push)}),))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def grpc_floor(num_bytes: int, chunk_bytes: int, repeats: int) -> float:
    import grpc

    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=30)}",
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            push = channel.stream_unary(f"/{_SERVICE}/Push")
            chunks = [os.urandom(chunk_bytes)] * (num_bytes // chunk_bytes)
            push(iter(chunks))  # warm-up
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                push(iter(chunks))
                times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        server.terminate()
        server.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="24,189", help="payload sizes (MiB): a 1k and an 8k SmolLM2 prompt's KV")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=2 << 30, log_to_driver=False, configure_logging=False)
    rows = []
    try:
        sender = ray.remote(num_cpus=1)(Sender).remote()
        receiver = ray.remote(num_cpus=1)(Receiver).remote()
        for mib in map(int, args.mib.split(",")):
            num_bytes = mib << 20
            local = ray.get(sender.run.remote(num_bytes, args.repeats))
            get_s = ray.get(receiver.get.remote(ray.get(sender.ref.remote()), args.repeats))
            row = {"MiB": mib, "memcpy_ms": 1e3 * local["memcpy_s"], "ray_put_ms": 1e3 * local["put_s"],
                   "ray_get_ms": 1e3 * get_s}
            for chunk_mib in (1, 2):
                row[f"grpc_{chunk_mib}MiB_chunks_ms"] = 1e3 * grpc_floor(num_bytes, chunk_mib << 20, max(3, args.repeats // 3))
            for name in [key for key in row if key.endswith("_ms")]:
                row[name.replace("_ms", "_GBps")] = num_bytes / (row[name] / 1e3) / 1e9
            row["ray_put_share_of_memcpy"] = row["memcpy_ms"] / row["ray_put_ms"]
            rows.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
