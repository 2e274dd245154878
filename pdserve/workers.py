"""pdserve's workers as Ray actors: the `WorkerFactory` the pool manager (router/pools/manager.py)
starts, stops and groups them through.

Each worker is an actor of `PrefillWorker` or `DecodeWorker` with `--cpus-per-worker` CPUs and, on
cuda, one GPU. On a cluster whose nodes carry the custom resources `pdserve_prefill` /
`pdserve_decode` (cluster.yaml), each pool's actors request theirs, so they land only on their own
node type.
"""

from __future__ import annotations

import asyncio
import logging
import os

from engine.dtypes import AUTO_DTYPE_ENV
from engine.kernel_env import KERNEL_ENV
from router.pools import WorkerStartError

log = logging.getLogger(__name__)

# set where `serve` runs, passed on to every worker (torch-free names)
WORKER_ENV = (AUTO_DTYPE_ENV, *KERNEL_ENV)

NODE_RESOURCE = {
    "prefill": "pdserve_prefill",
    "decode": "pdserve_decode",
    "colocated": "pdserve_decode",
}
_RESOURCE_PER_WORKER = 0.01  # a node type's marker, not a capacity: CPUs and GPUs bound the count


def _free_summary(free: dict[str, float]) -> str:
    """What is free, CPUs always named: Ray leaves a resource out of `available_resources` once none
    is free."""
    names = sorted({"CPU", *(name for name in free if name.startswith(("GPU", "pdserve")))})
    return ", ".join(f"{free.get(name, 0.0):g} {name}" for name in names)


class RayWorkerFactory:
    def __init__(self, config, epoch: int):
        self.config = config  # pdserve.system.ServeConfig
        self.epoch = epoch
        self.engine_config = config.engine_config()
        self._next_index = {"prefill": 0, "decode": 0, "colocated": 0}
        self._node_types_seen: set[str] = set()  # node-type resources some node offered once
        self._displaced: set[str] = set()  # ids of workers started off their node type

    def _actor_options(self, role: str) -> dict:
        import ray

        options = {"num_cpus": self.config.worker_cpus}
        # what "auto" resolves to, and the kernels' knobs (engine/kernels.py), on every node the
        # workers land on
        env = {name: os.environ[name] for name in WORKER_ENV if os.environ.get(name)}
        if env:
            options["runtime_env"] = {"env_vars": env}
        # One engine per GPU; Ray sets the actor's CUDA_VISIBLE_DEVICES. Under "auto" a worker
        # without a GPU of its own sees none (Ray hides them) and resolves to cpu.
        if self.config.device == "cuda" or (
            self.config.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1
        ):
            options["num_gpus"] = 1
        resource = NODE_RESOURCE[role]
        if resource in ray.cluster_resources():
            self._node_types_seen.add(resource)
            options["resources"] = {resource: _RESOURCE_PER_WORKER}
        return options

    def node_type_missing(self, role: str) -> bool:
        """Whether the cluster had nodes of this role's type and has no live one now."""
        import ray

        resource = NODE_RESOURCE[role]
        return resource in self._node_types_seen and resource not in ray.cluster_resources()

    def is_displaced(self, worker_id: str) -> bool:
        """Whether the worker was started off its node type, none being alive then."""
        return worker_id in self._displaced

    async def start(self, role: str, count: int) -> list:
        import ray

        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        options = self._actor_options(role)
        # a local node never grows: a pending actor would wait forever
        if self.config.address == "local":
            self._check_room(role, count, options)
        displaced = "resources" not in options and self.node_type_missing(role)
        actors = []
        for _ in range(count):
            worker_id = f"{role}-{self._next_index[role]}"
            self._next_index[role] += 1
            if displaced:
                self._displaced.add(worker_id)
                log.warning(
                    "%s: no live node offers %s: placed anywhere", worker_id, NODE_RESOURCE[role]
                )
            if role == "prefill":
                actor = (
                    self._actor_class(PrefillWorker)
                    .options(**options)
                    .remote(
                        worker_id,
                        self.engine_config,
                        self.config.transport,
                        self.epoch,
                        self.config.kv_timeout_s,
                        self.config.core_policy,
                    )
                )
            else:
                actor = (
                    self._actor_class(DecodeWorker)
                    .options(**options)
                    .remote(
                        worker_id,
                        self.engine_config,
                        self.config.transport,
                        self.config.worker_bind_host(),
                        role,
                        self.config.core_policy,
                    )
                )
            actors.append(actor)
        try:  # ready = engine loaded; on a cluster, the wait includes any nodes its autoscaler adds
            infos = await asyncio.wait_for(
                asyncio.gather(*(actor.info.remote() for actor in actors)),
                self.config.worker_start_timeout_s,
            )
        except asyncio.TimeoutError:
            for actor in actors:
                ray.kill(actor)
            raise WorkerStartError(
                f"{role}: {count} new worker(s) were not ready within "
                f"{self.config.worker_start_timeout_s:.0f} s (each needs {options}; free on the "
                f"cluster now: {_free_summary(ray.available_resources())})"
            ) from None
        return list(zip(actors, infos))

    def _actor_class(self, worker_class):
        import ray

        if self.config.transport != "rdt":
            return ray.remote(worker_class)
        from kvtransfer.rdt_transport import actor_class_options

        return ray.remote(**actor_class_options())(worker_class)

    def _check_room(self, role: str, count: int, options: dict) -> None:
        import ray

        free = ray.available_resources()
        needs = {
            "CPU": options["num_cpus"] * count,
            **{k: v * count for k, v in options.get("resources", {}).items()},
        }
        if "num_gpus" in options:
            needs["GPU"] = options["num_gpus"] * count
        short = {name: need for name, need in needs.items() if free.get(name, 0.0) + 1e-9 < need}
        if short:
            raise WorkerStartError(
                f"{role}: {count} more worker(s) need "
                f"{', '.join(f'{v:g} {k}' for k, v in needs.items())}; this local Ray node has "
                f"{_free_summary(free)} free of {ray.cluster_resources().get('CPU', 0.0):g} CPU "
                f"(each worker holds {options['num_cpus']:g}). Serve with a smaller "
                "--cpus-per-worker, or on a cluster (--address)"
            )

    def kill(self, actor) -> None:
        import ray

        ray.kill(actor)

    async def form_kv_group(self, senders: list, receivers: list, receiver_role: str) -> str:
        """--transport rdt: the collective group Ray Direct Transport moves KV within
        (kvtransfer/rdt_transport.py); nccl where workers hold a GPU, else gloo."""
        from kvtransfer.rdt_transport import form_group

        backend = "nccl" if "num_gpus" in self._actor_options(receiver_role) else "gloo"
        group = await asyncio.to_thread(form_group, senders, receivers, backend)
        log.info(
            "rdt transport: %s group %s over %d prefill + %d decode workers",
            backend,
            group,
            len(senders),
            len(receivers),
        )
        return group
