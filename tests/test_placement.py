"""On a multi-node Ray cluster (three nodes, all on 127.0.0.1), each pool lands only on its node
type."""

import asyncio
import threading

import pytest

from pdserve.client import PdserveClient
from pdserve.system import ServeConfig, start_system

pytestmark = pytest.mark.own_ray_cluster  # shuts the session's shared cluster down: runs first


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the session's shared single-node cluster (tests/conftest.py), if it is up
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "object_store_memory": 256 << 20,
        },
    )
    prefill_node = cluster.add_node(
        num_cpus=2,
        resources={"pdserve_prefill": 1},
        node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
    )
    decode_node = cluster.add_node(
        num_cpus=2,
        resources={"pdserve_decode": 1},
        node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
    )
    cluster.wait_for_nodes()
    yield cluster, prefill_node.node_id, decode_node.node_id
    ray.shutdown()
    cluster.shutdown()


def test_pools_are_placed_on_their_node_types_and_serve(cluster):
    ray_cluster, prefill_node_id, decode_node_id = cluster
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    # fp32: the answer's text is checked, and in bf16 this model answers otherwise
    # (docs/reliability.md)
    config = ServeConfig(
        address=ray_cluster.address,
        port=0,
        num_prefill=2,
        num_decode=1,
        kv_cache_bytes=32 << 20,
        transport="grpc",
        dtype="float32",
    )
    system = asyncio.run_coroutine_threadsafe(start_system(config), loop).result(300)
    try:
        with PdserveClient(port=system.port, timeout_s=120) as client:
            answer = client.chat("What is the capital of France?", max_tokens=12, temperature=0)
            stats = client.stats()
        assert "Paris" in answer.text
        nodes = {w.worker_id: w.node for w in stats.workers}
        assert nodes["prefill-0"] == nodes["prefill-1"] == prefill_node_id[:12]
        assert nodes["decode-0"] == decode_node_id[:12]
    finally:
        asyncio.run_coroutine_threadsafe(system.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
