"""cluster.yaml is a real Ray cluster-launcher config: it passes the schema check `ray up` runs."""

from pathlib import Path

import yaml

CLUSTER_YAML = Path(__file__).resolve().parent.parent / "cluster.yaml"


def test_cluster_yaml_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER_YAML.read_text())
    validate_config(prepare_config(config))  # raises on any schema error
    node_types = config["available_node_types"]
    assert node_types["prefill"]["resources"]["pdserve_prefill"] == 1
    assert node_types["decode"]["resources"]["pdserve_decode"] == 1
    assert config["head_node_type"] == "head"


def test_decode_workers_bind_loopback_locally_and_their_node_address_on_a_cluster():
    from pdserve.system import ServeConfig

    assert ServeConfig().worker_bind_host() == "127.0.0.1"
    # each worker resolves its node's address
    assert ServeConfig(address="auto").worker_bind_host() is None
    assert ServeConfig(address="auto", kv_host="0.0.0.0").worker_bind_host() == "0.0.0.0"


def test_ipv6_hosts_are_bracketed_in_addresses():
    from protocol.addresses import host_port

    assert host_port("::", 0) == "[::]:0" and host_port("[::1]", 5) == "[::1]:5"
    assert host_port("10.0.0.7", 50051) == "10.0.0.7:50051"
