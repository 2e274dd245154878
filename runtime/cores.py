"""Lending idle cores between the workers of one node.

Each worker computes on the threads Ray granted it (its *home* cores). When another worker on the
same node has nothing to compute, its cores sit idle: in a 1 prefill + 1 decode system on two cores,
the decode worker prefills a conversation's later turn on one core while the prefill worker's core
waits for a prompt. `CoreShare` lets a worker borrow such cores for (at most) one engine step at a
time, and guarantees that the threads of all workers never exceed the node's cores (two torch
processes each spinning two threads on two cores slow decode 10-20x: docs/benchmarks-archive.md,
2026-12-02, SLO-aware core sharing).

The agreement is kept in lock files, one per core, in a directory every worker of the node opens
(`/dev/shm`, so nothing outlives a reboot; a process that dies drops its locks with it):

- `homes.json` (edited under `registry.lock`) gives each worker process its home cores: the least
  used ones when it starts. Workers granted a fraction of a CPU share a home core, as they share it
  anyway.
- While a worker has work (unfinished requests) it holds a shared lock on each home core, from the
  first step of a busy spell to the moment it goes idle.
- A borrower takes an exclusive lock, without waiting, on another worker's home core that nobody
  holds, for the length of one engine step, and runs that step on its home threads plus the borrowed
  ones. Only cores granted to a worker are lent: the node's other cores are Ray's to give to other
  tasks. A worker whose home core is shared never borrows: the workers sharing it may already run
  more threads than cores.
- An owner that becomes busy while its core is lent takes the core's `want` lock and polls for the
  core. The borrower checks `want` between the model's layers and hands the core back there, so the
  owner waits one layer (milliseconds); it checks `want` before borrowing again too. A borrower that
  stopped (SIGSTOP, a debugger) cannot hold an owner for longer than `owner_wait_s`: the owner then
  runs anyway, logs it, and keeps its `want` lock until it has the core back.
- Cores are shared by the SLO, not only when idle. A prefill step that could not borrow a core
  because its owner is busy *asks* for it (a shared lock on the core's `ask` file) and tries again
  between layers. An owner that is only decoding, whose streams have TPOT slack (`decode_slack_s`:
  the time each stream is ahead of `CorePolicy.tpot_budget_s` per token, less its next step), lends
  its home cores to the asker for at most that slack, and at most `max_pause_tpot` TPOT budgets at a
  time, then takes them back as above. So a prompt prefills on both cores while decoding streams
  stay within the SLO. The owner looks for an ask at every layer boundary of its decode step too
  (a millisecond apart), not only between steps, and decides at most once per token, so no gap
  between two tokens exceeds one pause and one step; the asking prefill waits up to `ask_wait_s`
  for the lend before its first layer (a prefill layer on one thread takes tens of milliseconds).

Lock calls are a few microseconds; a step is tens of milliseconds at least.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from runtime.cpus import usable_cpus

log = logging.getLogger(__name__)

POLICIES = ("off", "prefill", "all")
_REGISTRY_REFRESH_S = 1.0
# Lending within the TPOT budget counts on a stream running this many more tokens at most (or to its
# max_tokens): one that stops sooner, at EOS, can end a little over the budget
SLACK_HORIZON_TOKENS = 64
# a pause shorter than this is not worth taking the cores (the planner's simulator reads it too)
MIN_PAUSE_S = 0.005


@dataclass(frozen=True)
class CorePolicy:
    """`lend`: which steps may borrow idle cores: `all` (the default: decode steps too, measured
    faster in docs/benchmarks-archive.md), `prefill` (only steps that compute prompt tokens), `off`.
    `directory`: where the node's workers keep their locks (None:
    `/dev/shm/pdserve-cores-<uid>`)."""

    lend: str = "all"
    directory: Optional[str] = None
    owner_wait_s: float = 5.0
    poll_s: float = 0.001
    # The SLO's TPOT: a decoding worker lends its cores to a node's prefill while its streams stay
    # within it (None: only idle cores are lent). One lending pause is at most `max_pause_tpot` of
    # it (the longest gap between two tokens it adds).
    tpot_budget_s: Optional[float] = None
    max_pause_tpot: float = 4.0
    # How long a prefill step that asks for busy cores waits for them before its first layer: a
    # decoding owner looks at every layer boundary of its step (about a millisecond apart), and a
    # prefill layer on one thread takes tens of milliseconds, so a lent core taken at the first
    # layer boundary instead of the second is worth a short wait
    ask_wait_s: float = 0.005
    # A stream lends while it is expected to end within this share of the budget: the rest is the
    # margin for pauses yet to come and for noise (at 0.9, TPOT p50 rose to 45 ms of 50 and a fifth
    # of the requests missed it; docs/benchmarks-archive.md)
    tpot_share: float = 0.75

    def __post_init__(self) -> None:
        if self.lend not in POLICIES:
            raise ValueError(
                f"--lend-cores must be one of {', '.join(POLICIES)}, got {self.lend!r}"
            )

    @property
    def path(self) -> Path:
        if self.directory is not None:
            return Path(self.directory)
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return base / f"pdserve-cores-{os.getuid()}"


@dataclass(frozen=True)
class StreamProgress:
    """A decoding stream, as the decision to lend a decoding worker's cores sees it."""

    output_tokens: int  # decoded so far
    max_tokens: int
    decoding_s: float  # since it started decoding on this worker


def decode_slack_s(
    streams: list[StreamProgress], step_s: float, policy: CorePolicy
) -> Optional[float]:
    """How long a decoding worker's next step may wait, for a prefill that asks for its cores, with
    every stream expected to end within `tpot_share` of the TPOT budget: None when no budget is set.
    A stream is expected to run to its max_tokens, at most `SLACK_HORIZON_TOKENS` more, at the mean
    decode step `step_s`: so a young stream may lend the time it will save later, not only what it
    saved. A stream that misses the budget itself even if never paused again does not hold the cores
    back (it misses either way); when every stream does, None: the worker is overloaded and its
    cores decode. Shared with the planner's simulator, so the two cannot drift."""
    budget_s = policy.tpot_budget_s
    if budget_s is None:
        return None
    slacks = []
    for stream in streams:
        tokens = stream.output_tokens
        final_tokens = max(tokens, min(stream.max_tokens, tokens + SLACK_HORIZON_TOKENS))
        needed_s = stream.decoding_s + (final_tokens - tokens + 1) * step_s
        if needed_s > budget_s * final_tokens:
            continue
        slacks.append(policy.tpot_share * budget_s * final_tokens - needed_s)
    return min(slacks, default=None)


class CoreShare:
    """One worker's side of the agreement. Used from its engine thread only: torch's thread count is
    the calling thread's."""

    def __init__(
        self,
        policy: CorePolicy,
        home_threads: int,
        set_threads: Callable[[int], None],
        num_cores: Optional[int] = None,
    ):
        """`set_threads`: torch.set_num_threads (this module stays torch-free: the router validates
        the policy)."""
        self.policy = policy
        self._set_threads = set_threads
        self.num_cores = num_cores or usable_cpus()
        # Borrowed cores are other workers' homes: with the home within the node's cores, home plus
        # borrowed threads never exceed them.
        self.home_threads = min(home_threads, self.num_cores)
        self.directory = policy.path
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._key = f"{os.getpid()}-{id(self)}"
        self.home = self._register()
        self._core_fds = [self._open(f"core-{i}") for i in range(self.num_cores)]
        self._want_fds = [self._open(f"want-{i}") for i in range(self.num_cores)]
        self._ask_fds = [self._open(f"ask-{i}") for i in range(self.num_cores)]
        # other workers' cores a prefill step under way asks for, lent or not
        self._asks: list[int] = []
        # decode pauses that lent the home cores to a prefill, and their total time
        self.lent_pauses = 0
        self.lent_pauses_s = 0.0
        self._holding_home = False
        self._missing: list[int] = []  # home cores still lent when it stopped waiting for them
        self._registry_stamp: Optional[int] = None
        self._others_homes: frozenset[int] = frozenset()
        self._home_shared = False
        self._registry_read_s = 0.0
        self.threads = self.home_threads  # what the engine thread computes with now
        self._borrowed: list[int] = []  # cores lent to the step under way
        self.borrowed_steps = 0  # steps that ran on borrowed cores
        self.owner_waits_s = 0.0  # time spent waiting for a borrower to hand a home core back

    def _open(self, name: str) -> int:
        return os.open(self.directory / name, os.O_RDWR | os.O_CREAT, 0o600)

    def _register(self) -> tuple[int, ...]:
        """This worker's home cores: the least used among live workers' (a dead one's are free
        again)."""

        def claim(homes: dict) -> tuple[int, ...]:
            use = [0] * self.num_cores
            for cores in homes.values():
                for core in cores:
                    if core < self.num_cores:
                        use[core] += 1
            count = min(self.home_threads, self.num_cores)
            chosen = tuple(
                sorted(sorted(range(self.num_cores), key=lambda core: (use[core], core))[:count])
            )
            homes[self._key] = list(chosen)
            return chosen

        return self._edit_registry(claim)

    def close(self) -> None:
        """Gives the home cores back (a process that just dies gives them back too: its locks go
        with it, and the next registration drops its entry)."""
        self._edit_registry(lambda homes: homes.pop(self._key, None))
        for fd in self._core_fds + self._want_fds + self._ask_fds:
            os.close(fd)
        self._core_fds = self._want_fds = self._ask_fds = []

    def _edit_registry(self, edit: Callable[[dict], Any]) -> Any:
        """Runs `edit` on the live workers' entries under the registry's lock and writes them
        back."""
        lock = self._open("registry.lock")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            registry_path = self.directory / "homes.json"
            try:
                homes = json.loads(registry_path.read_text())
            except (OSError, ValueError):
                homes = {}
            homes = _live(homes)
            result = edit(homes)
            temporary = registry_path.with_suffix(f".{self._key}")
            temporary.write_text(json.dumps(homes))
            os.replace(temporary, registry_path)
            return result
        finally:
            os.close(lock)  # closing drops the lock

    # -- a busy spell --------------------------------------------------------------------------

    def busy(self) -> None:
        """Holds the home cores for as long as this worker has work; if one is lent, waits (at most
        `owner_wait_s`) for the borrower to hand it back at its next layer boundary."""
        if self._holding_home:
            if self._missing:  # gave up waiting earlier: take each back as soon as it is free
                self._missing = self._take_home(self._missing)
            return
        started = time.monotonic()
        waiting = self._take_home(self.home)
        if waiting:
            while waiting and time.monotonic() - started < self.policy.owner_wait_s:
                time.sleep(self.policy.poll_s)
                waiting = self._take_home(waiting)
            self.owner_waits_s += time.monotonic() - started
        if waiting:  # their want locks stay held, so no one borrows those cores again meanwhile
            log.warning(
                "home core(s) %s still lent after %.1f s: computing anyway",
                waiting,
                self.policy.owner_wait_s,
            )
        self._missing = waiting
        self._holding_home = True

    def _take_home(self, cores) -> list[int]:
        """Takes each home core it can; holds the `want` lock of the others (a borrower checks it
        before taking one again), and returns those."""
        missing = []
        for core in cores:
            if _try_lock(self._core_fds[core], fcntl.LOCK_SH):
                fcntl.flock(self._want_fds[core], fcntl.LOCK_UN)
            else:
                fcntl.flock(self._want_fds[core], fcntl.LOCK_SH)
                missing.append(core)
        return missing

    def idle(self) -> None:
        """Nothing left to compute: the home cores may be lent."""
        if not self._holding_home:
            return
        for core in self.home:
            fcntl.flock(self._core_fds[core], fcntl.LOCK_UN)
            fcntl.flock(self._want_fds[core], fcntl.LOCK_UN)
        self._missing = []
        self._holding_home = False

    # -- one step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, is_prefill: bool) -> Iterator[Optional[Callable[[], None]]]:
        """Runs one engine step on the home threads plus any idle cores the policy lets it borrow.
        Yields what the model should call between layers (None when there is nothing to do there):
        it hands a borrowed core back at once when its owner wants it, so an owner waits one layer,
        not a whole step; a prefill step also asks for the busy cores it could not borrow, and takes
        them when lent."""
        lends = self.policy.lend == "all" or (self.policy.lend == "prefill" and is_prefill)
        self._borrowed = self._borrow() if lends else []
        if is_prefill and self.policy.tpot_budget_s is not None and not self._home_shared:
            # held for the whole step: an owner lends until it ends
            self._ask(sorted(self._lendable()))
            self._await_lent(self.policy.ask_wait_s)
        if self._borrowed:
            self._use_threads(self.home_threads + len(self._borrowed))
            self.borrowed_steps += 1
        try:
            yield self._between_layers if self._borrowed or self._asks else None
        finally:
            self._ask([])
            self._release_borrowed()

    def _release_borrowed(self) -> None:
        if self._borrowed:
            self._use_threads(self.home_threads)  # fewer threads before the cores are free
            for core in self._borrowed:
                fcntl.flock(self._core_fds[core], fcntl.LOCK_UN)
            self._borrowed = []

    def _take_lent(self) -> list[int]:
        """Borrows each asked-for core that is lent now; returns those."""
        taken = [
            core for core in self._asks if core not in self._borrowed and self._try_borrow(core)
        ]
        self._borrowed += taken
        return taken

    def _await_lent(self, wait_s: float) -> None:
        """Takes the asked-for cores lent within `wait_s`, polling every `poll_s` / 10."""
        deadline = time.monotonic() + wait_s
        while set(self._asks) - set(self._borrowed) and time.monotonic() < deadline:
            time.sleep(self.policy.poll_s / 10)
            self._take_lent()

    def _between_layers(self) -> None:
        self._hand_back_wanted()
        borrowing = bool(self._borrowed)
        if self._take_lent():
            if not borrowing:
                self.borrowed_steps += 1
            self._use_threads(self.home_threads + len(self._borrowed))

    def _ask(self, cores: list[int]) -> None:
        """Holds the `ask` lock of exactly `cores`: their busy owners may lend them
        (`lend_within`)."""
        for core in set(self._asks) - set(cores):
            fcntl.flock(self._ask_fds[core], fcntl.LOCK_UN)
        for core in set(cores) - set(self._asks):
            fcntl.flock(self._ask_fds[core], fcntl.LOCK_SH)
        self._asks = list(cores)

    def lend_within(self, slack_s: float, meanwhile: Callable[[], None] = lambda: None) -> float:
        """Between two decode steps of a busy worker, or at a layer boundary of one: if a prefill
        on the node asks for its home cores, lends them for at most `slack_s` (what its streams can
        wait without missing the TPOT budget) and at most `max_pause_tpot` budgets, or until nobody
        asks; then takes them back. Cores the step under way borrowed go back first (the step
        resumes on its home threads). `meanwhile` runs every poll (the worker's calls and transport
        polls). Returns the pause."""
        budget_s = self.policy.tpot_budget_s
        if budget_s is None or not self._holding_home or self._missing or self._home_shared:
            return 0.0
        pause_s = min(slack_s, self.policy.max_pause_tpot * budget_s)
        if pause_s <= MIN_PAUSE_S or not self.asked():
            return 0.0
        started = time.monotonic()
        self._release_borrowed()
        self.idle()
        while time.monotonic() - started < pause_s and self.asked():
            time.sleep(self.policy.poll_s)
            meanwhile()
        self.busy()
        paused_s = time.monotonic() - started
        self.lent_pauses += 1
        self.lent_pauses_s += paused_s
        return paused_s

    def asked(self) -> bool:
        """Whether a prefill step asks for one of the home cores now."""
        for core in self.home:
            if not _try_lock(self._ask_fds[core], fcntl.LOCK_EX):
                return True
            fcntl.flock(self._ask_fds[core], fcntl.LOCK_UN)
        return False

    def _hand_back_wanted(self) -> None:
        wanted = [
            core for core in self._borrowed if not _try_lock(self._want_fds[core], fcntl.LOCK_EX)
        ]
        for core in self._borrowed:
            if core not in wanted:
                fcntl.flock(self._want_fds[core], fcntl.LOCK_UN)
        if wanted:
            self._borrowed = [core for core in self._borrowed if core not in wanted]
            # fewer threads before the core is free
            self._use_threads(self.home_threads + len(self._borrowed))
            for core in wanted:
                fcntl.flock(self._core_fds[core], fcntl.LOCK_UN)

    def _use_threads(self, count: int) -> None:
        self.threads = count
        self._set_threads(count)

    def _lendable(self) -> frozenset[int]:
        """The other live workers' home cores (re-read when the registry changed, and every second:
        a worker that died leaves its entry until the next registration)."""
        registry_path = self.directory / "homes.json"
        try:
            stamp = registry_path.stat().st_mtime_ns
        except OSError:
            return frozenset()
        now = time.monotonic()
        if stamp != self._registry_stamp or now - self._registry_read_s > _REGISTRY_REFRESH_S:
            self._registry_read_s = now
            try:
                homes = json.loads(registry_path.read_text())
            except (OSError, ValueError):
                return frozenset()
            self._registry_stamp = stamp
            others = frozenset(
                core
                for key, cores in _live(homes).items()
                if key != self._key
                for core in cores
                if core < self.num_cores
            )
            self._home_shared = bool(others & frozenset(self.home))
            self._others_homes = others - frozenset(self.home)
        return self._others_homes

    def _borrow(self) -> list[int]:
        lendable = self._lendable()
        if self._home_shared:
            # Its home core is another worker's too, and that one may be computing on it: threads
            # beyond the cores already. Borrowing would add one more.
            return []
        return [core for core in sorted(lendable) if self._try_borrow(core)]

    def _try_borrow(self, core: int) -> bool:
        if not _try_lock(self._want_fds[core], fcntl.LOCK_EX):
            return False  # its owner is waiting for it
        fcntl.flock(self._want_fds[core], fcntl.LOCK_UN)
        return _try_lock(self._core_fds[core], fcntl.LOCK_EX)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _live(homes: dict[str, list[int]]) -> dict[str, list[int]]:
    """The registry's entries whose process is alive (a key is "<pid>-<share>")."""
    return {key: cores for key, cores in homes.items() if _alive(int(key.split("-")[0]))}


def _alive(pid: int) -> bool:
    """Whether `pid` may still compute: a zombie (exited, not yet reaped by its parent) holds no
    locks and runs no threads, though signalling it succeeds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs (macOS): signalling it succeeded
        return True
