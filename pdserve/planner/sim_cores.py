"""The simulator's cores (runtime/cores.py as the planner models it): where a step runs and how long
it takes there.

- Workers are packed onto nodes of the profile's cores, first fit by Ray CPUs, with home cores as
  the workers claim them; workers granted a fraction of a CPU share a home core.
- A step's time on its threads is the profile's engine time as the servers ran it, plus the serving
  path's costs (`Profile.serving`) and those of a step on borrowed cores.
- A step borrows the home cores of idle workers of its node; a prefill step the cores of a worker
  that is only decoding too, for the slack its streams have against the SLO's TPOT (the engine
  loop's formula), at most `CorePolicy.max_pause_tpot` budgets at a time and again after each of
  that worker's decode steps while the slack lasts.
- Each busy step of a node runs at min(1, cores / busy threads) of its speed, recomputed whenever a
  step of the node starts or ends (processor sharing: nothing pins a thread to a core, so where
  workers share home cores the OS divides the node's cores among the busy ones).

`CoreModel` is a part of `simulator.Simulation`, which holds the state it reads: `profile`,
`shape`, `policy`, `slo`, `node_cores`, `now_s`, `workers`, `prefill`, `decode`, and the event
calls `_at`, `_step_done`, `_decode_batch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from runtime.cores import MIN_PAUSE_S, StreamProgress, decode_slack_s

if TYPE_CHECKING:
    from pdserve.planner.simulator import _Worker


class CoreModel:
    """Where a `Simulation`'s steps run and how long they take there (above)."""

    def _place_on_nodes(self, workers: list[_Worker]) -> None:
        """First fit by Ray CPUs, one node after another; home cores as runtime/cores.py claims
        them."""
        cpus = self.shape.cpus_per_worker
        per_node = max(1, int(self.node_cores / cpus + 1e-9))
        threads = min(self.shape.threads_per_worker, self.node_cores)
        for index, worker in enumerate(workers):
            worker.node = index // per_node
            used = [0] * self.node_cores
            for other in workers[:index]:
                if other.node == worker.node:
                    for core in other.home:
                        used[core] += 1
            worker.home = tuple(
                sorted(sorted(range(self.node_cores), key=lambda c: (used[c], c))[:threads])
            )
        for worker in workers:
            worker.home_shared = any(
                set(worker.home) & set(o.home)
                for o in workers
                if o is not worker and o.node == worker.node
            )

    def _share_cores(self, node: int) -> None:
        """Each busy step of the node goes on from now at its share of the node's cores, min(1,
        cores / busy threads): nothing pins a thread to a core, so where workers share home cores
        (fractional CPUs) the OS divides the node's cores among the busy ones. A step whose share
        changed gets its end moved."""
        busy = [w for w in self.workers if w.node == node and w.step is not None]
        rate = min(1.0, self.node_cores / max(1, sum(len(w.home) for w in busy)))
        for worker in busy:
            step = worker.step
            if step.rate == rate and step.version:
                continue  # its end stands
            step.work_s -= (self.now_s - step.rated_s) * step.rate
            step.rate, step.rated_s, step.version = rate, self.now_s, step.version + 1
            self._at(worker.busy_until_s, self._step_done, (worker, step, step.version))

    def _step_s(self, worker: _Worker, is_prefill: bool, chunks, threads: int) -> float:
        serving = self.profile.serving
        borrowed = serving is not None and threads > len(worker.home)
        if is_prefill:
            compute_s = sum(
                self.profile.chunk_s(s.computed_tokens, s.computed_tokens + n, threads)
                for s, n in chunks
            )
            if serving is None:
                return compute_s
            compute_s *= 1 + serving.prefill_share
            if not borrowed:
                return compute_s
            return serving.borrow_prefill_s + compute_s * (1 + serving.borrow_prefill_share)
        context = sum(s.context_tokens for s, _ in chunks) / len(chunks)
        step_s = self.profile.decode_step_s(len(chunks), context, threads)
        if serving is None:
            return step_s
        step_s *= 1 + serving.decode_share
        # the serving path's own work per decode step and token streamed, and a borrowed step's
        return (
            step_s
            + serving.decode_step_s(len(chunks))
            + (serving.borrow_decode_s if borrowed else 0.0)
        )

    def _duration_s(self, worker: _Worker, is_prefill: bool, chunks) -> float:
        node = [w for w in self.prefill + self.decode if w.node == worker.node and w is not worker]
        threads = len(worker.home)
        lenders = []
        if self.shape.lend_cores and not worker.home_shared:
            lenders = [o for o in node if o.idle and not o.home_shared]
            threads += sum(len(o.home) for o in lenders)
        base_s = self._step_s(worker, is_prefill, chunks, threads)
        if not (is_prefill and self.shape.lend_cores and not worker.home_shared):
            return base_s
        for owner in node:  # a decoding owner lends its cores within its streams' TPOT slack
            if owner in lenders or owner.home_shared or owner.waiting or not owner.running:
                continue
            wait_s = max(0.0, (owner.busy_until_s or self.now_s) - self.now_s)
            slack_s = self._slack_s(owner, self.now_s + wait_s)
            if slack_s <= MIN_PAUSE_S or wait_s >= base_s:
                continue
            fast_s = self._step_s(worker, is_prefill, chunks, threads + len(owner.home))
            return self._lent_s(owner, base_s, fast_s, wait_s, slack_s)
        return base_s

    def _lent_s(
        self, owner: _Worker, base_s: float, fast_s: float, wait_s: float, slack_s: float
    ) -> float:
        """A prefill step of `base_s` on its home cores (`fast_s` with the owner's too) that asks a
        decoding owner for its cores, as runtime/cores.py runs it: on its home cores until the
        owner's step ends (`wait_s`); then the owner lends them for at most `max_pause_tpot` TPOT
        budgets, takes them back for one decode step, and lends them again while its streams'
        slack lasts (each pause spends as much of it), until the step is done. The owner stays
        paused until its last pause ends (its decode steps between pauses are left out: a few tens
        of milliseconds a prompt); an event then wakes it."""
        max_pause_s = self.policy.max_pause_tpot * self.slo.tpot_s
        # its step between two pauses, on its own cores (the prefill holds the ones it could borrow)
        _, batch = self._decode_batch(owner)
        owner_step_s = self._step_s(owner, False, batch, len(owner.home))
        left = 1.0 - wait_s / base_s  # of the step's work, when the owner's step ends
        elapsed_s = wait_s
        while left > 0:
            pause_s = min(slack_s, max_pause_s)
            if pause_s <= MIN_PAUSE_S:
                break
            if left * fast_s <= pause_s:
                elapsed_s += left * fast_s
                left = 0.0
            else:
                elapsed_s += pause_s
                left -= pause_s / fast_s
                slack_s -= pause_s
            owner.paused_until_s = self.now_s + elapsed_s
            between_s = min(owner_step_s, left * base_s)  # the owner's step, on its own cores
            elapsed_s += between_s
            left -= between_s / base_s
        if owner.paused_until_s > self.now_s:
            self._at(owner.paused_until_s, self._resume, owner)
        return elapsed_s + left * base_s

    def _resume(self, owner: _Worker) -> None:
        """A lending owner's pause ends: the run loop starts its next step (nothing else to do)."""

    def _slack_s(self, owner: _Worker, now_s: float, step_s: Optional[float] = None) -> float:
        """The engine loop's slack (`runtime.cores.decode_slack_s`) for the owner's running streams,
        at its mean decode step since start (lending) or at `step_s` (its recent step: the slack it
        reports to the PD policy); 0 (nothing to lend) where it has none."""
        if not owner.decode_steps:
            return 0.0
        streams = [
            StreamProgress(
                len(stream.token_times_s),
                stream.request.output_tokens,
                now_s - stream.decode_started_s,
            )
            for stream in owner.running
        ]
        step_s = step_s or owner.decode_steps_s / owner.decode_steps
        slack_s = decode_slack_s(streams, step_s, self.policy)
        return 0.0 if slack_s is None else slack_s
