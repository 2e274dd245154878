"""The floors under the KV handoff's targets (issue #3): what each transport's own mechanism costs
with no KV work around it, against memcpy measured in the same run.

    .venv/bin/python -m benchmarks.kv_transport_floor [--mib 24,189] [--repeats 9]

- memcpy: one copy into a preallocated, warm buffer (numpy `copyto`), inside a Ray actor;
- `ray.put`: the same bytes put into the object store by that actor (plasma preallocated, warm: the
  object of the previous repeat freed first). The ray transport's sender cannot do less than this;
- `ray.get`: another actor maps the object (zero-copy) and reads one byte per page;
- gRPC: a bare Python gRPC client stream of prebuilt 1 and 2 MiB `bytes` chunks (identity
  serializers) to a server in another process that only counts them; the grpc transport's floor;
- rdt: two actors in a gloo group (kvtransfer/rdt_transport.py). "pull" is the rdt transport's
  mechanism with no KV work: the receiving actor asks the other for a prebuilt tensor with
  `tensor_transport="gloo"` and passes the ref to a task on itself that touches every page; "gloo"
  is `ray.util.collective` send/recv of the same bytes into a warm preallocated buffer, no Ray task
  per transfer: the floor under the pull.
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
import torch  # noqa: E402

from kvtransfer.rdt_transport import CONCURRENCY_GROUP, actor_class_options, form_group  # noqa: E402

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


class RdtEnd:
    def __init__(self):
        torch.set_num_threads(1)
        self.payload = None

    def stage(self, num_bytes: int) -> None:
        self.payload = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)

    def staged(self) -> torch.Tensor:
        return self.payload

    def pull(self, sender, repeats: int) -> float:
        me = ray.get_runtime_context().current_actor
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            ref = sender.staged.options(tensor_transport="gloo").remote()
            ray.get(
                me.__ray_call__.options(concurrency_group=CONCURRENCY_GROUP).remote(_touch, ref)
            )
            times.append(time.perf_counter() - started)
            del ref
        return statistics.median(times[1:])


def _touch(_actor, tensor: torch.Tensor) -> int:
    return int(tensor[::4096].sum())


def _gloo_send(_actor, group: str, num_bytes: int, repeats: int) -> None:
    import ray.util.collective as collective

    payload = torch.ones(num_bytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        collective.send(payload, 1, group)


def _gloo_recv(_actor, group: str, num_bytes: int, repeats: int) -> float:
    import ray.util.collective as collective

    target = torch.zeros(num_bytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        collective.recv(target, 0, group)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def rdt_floor(num_bytes: int, repeats: int) -> tuple[float, float]:
    """(pull s, bare gloo s) between two fresh actors in one gloo group."""
    end = ray.remote(num_cpus=1, **actor_class_options())(RdtEnd)
    sender, receiver = end.remote(), end.remote()
    try:
        group = form_group([sender], [receiver], backend="gloo")
        ray.get(sender.stage.remote(num_bytes))
        pull_s = ray.get(receiver.pull.remote(sender, repeats))
        sent = sender.__ray_call__.remote(_gloo_send, group, num_bytes, repeats)
        gloo_s = ray.get(receiver.__ray_call__.remote(_gloo_recv, group, num_bytes, repeats))
        ray.get(sent)
        return pull_s, gloo_s
    finally:
        ray.kill(sender), ray.kill(receiver)


def _serve(ports: "multiprocessing.Queue") -> None:
    import grpc

    def push(frames, context):
        return sum(len(frame) for frame in frames).to_bytes(8, "little")

    server = grpc.server(
        futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                _SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(push)}
            ),
        )
    )
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def grpc_floor(num_bytes: int, chunk_bytes: int, repeats: int) -> float:
    import grpc

    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        with grpc.insecure_channel(
            f"127.0.0.1:{ports.get(timeout=30)}",
            options=[("grpc.max_send_message_length", 64 << 20)],
        ) as channel:
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mib", default="24,189", help="payload sizes (MiB): a 1k and an 8k SmolLM2 prompt's KV"
    )
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=2 << 30,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
    )
    rows = []
    try:
        sender = ray.remote(num_cpus=1)(Sender).remote()
        receiver = ray.remote(num_cpus=1)(Receiver).remote()
        for mib in map(int, args.mib.split(",")):
            num_bytes = mib << 20
            local = ray.get(sender.run.remote(num_bytes, args.repeats))
            get_s = ray.get(receiver.get.remote(ray.get(sender.ref.remote()), args.repeats))
            row = {
                "MiB": mib,
                "memcpy_ms": 1e3 * local["memcpy_s"],
                "ray_put_ms": 1e3 * local["put_s"],
                "ray_get_ms": 1e3 * get_s,
            }
            for chunk_mib in (1, 2):
                row[f"grpc_{chunk_mib}MiB_chunks_ms"] = 1e3 * grpc_floor(
                    num_bytes, chunk_mib << 20, max(3, args.repeats // 3)
                )
            pull_s, gloo_s = rdt_floor(num_bytes, args.repeats)
            row["rdt_pull_ms"], row["gloo_send_recv_ms"] = 1e3 * pull_s, 1e3 * gloo_s
            for name in [key for key in row if key.endswith("_ms")]:
                row[name.replace("_ms", "_GBps")] = num_bytes / (row[name] / 1e3) / 1e9
            row["ray_put_share_of_memcpy"] = row["memcpy_ms"] / row["ray_put_ms"]
            rows.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
