"""The README's scaling sequence on a local Ray node the size of this machine: `serve --prefill 1
--decode 1`, then `scale --decode 2` works (workers share the cores); a scale-up beyond the node is
refused at once with the numbers."""

import grpc
import pytest

from runtime.cpus import usable_cpus
from tests.serving_harness import Harness

pytestmark = pytest.mark.own_ray_cluster  # shuts the session's shared cluster down: runs first


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    import ray

    # the session's shared cluster (tests/conftest.py), if it is up: this one is the node's size
    ray.shutdown()
    # the node `pdserve serve` starts here
    harness = Harness(str(tmp_path_factory.mktemp("cores")), num_cpus=usable_cpus())
    running = harness.start(num_prefill=1, num_decode=1)
    yield running
    running.stop()
    harness.close()


def test_the_readme_scale_up_works_on_this_machine_and_a_refusal_names_the_numbers(system):
    cpus = system.system.config.worker_cpus
    assert cpus * 4 <= usable_cpus() + 1e-9
    with system.client() as client:
        reply = client.scale(decode=2)
        assert (reply.prefill, reply.decode) == (1, 2)
        done = client.chat("Name a river.", max_tokens=4, temperature=0)
        assert len(done.token_ids) == 4
        stats = client.stats()
        assert all(w.threads >= 1 and w.cpus == pytest.approx(cpus) for w in stats.workers), stats
        with pytest.raises(grpc.RpcError) as refused:
            client.scale(decode=int(usable_cpus() / cpus) + 1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    free = usable_cpus() - 3 * cpus
    assert (
        f"{cpus:g} CPU" in details and f"{free:g} CPU free of {usable_cpus():g} CPU" in details
    ), details
