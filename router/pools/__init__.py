"""The worker pools: this package owns each worker's state and each pool's size.

- `workers`: a worker as the router sees it (`WorkerHandle`), its `WorkerState` and the methods that
  alone change it, and a role's `WorkerPool`;
- `manager`: `PoolManager` adds, drains, stops and replaces workers (the actors behind them come
  from a `WorkerFactory`: pdserve/workers.py's Ray actors in serving), and `AutoscaleLoop` applies
  the autoscaling policy's decisions;
- `autoscaler`: that policy, a pure function of the router's signals and the time (`--autoscale`,
  `PlanTarget` for `--autoscale plan`).

The router's own modules import from `router.pools.workers`, not from this package: importing the
package runs `manager`, which imports `router.failures`, itself a user of `workers`.
"""

from router.pools.autoscaler import (
    AutoscaleConfig,
    AutoscalePolicy,
    Decision,
    PlannedSize,
    PlanTarget,
    Signals,
)
from router.pools.manager import AutoscaleLoop, PoolManager, WorkerFactory
from router.pools.workers import (
    NoWorkerError,
    WorkerHandle,
    WorkerPool,
    WorkerStartError,
    WorkerState,
)

__all__ = [
    "AutoscaleConfig",
    "AutoscaleLoop",
    "AutoscalePolicy",
    "Decision",
    "NoWorkerError",
    "PlannedSize",
    "PlanTarget",
    "PoolManager",
    "Signals",
    "WorkerFactory",
    "WorkerHandle",
    "WorkerPool",
    "WorkerStartError",
    "WorkerState",
]
