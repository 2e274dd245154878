"""Lending idle cores between a node's workers (runtime/cores.py). Two `CoreShare`s in one process
hold their locks through separate open files, so they contend exactly as two worker processes do."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from runtime.cores import CorePolicy, CoreShare, StreamProgress, decode_slack_s


class Threads:
    """Stands in for torch.set_num_threads: what each share asked for, in order."""

    def __init__(self):
        self.calls = []

    def __call__(self, count):
        self.calls.append(count)


@pytest.fixture
def node(tmp_path):
    shares = []

    def share(lend="prefill", home_threads=1, num_cores=2, **policy):
        threads = Threads()
        core_share = CoreShare(
            CorePolicy(lend, str(tmp_path), **policy), home_threads, threads, num_cores
        )
        core_share.calls = threads.calls
        shares.append(core_share)
        return core_share

    yield share
    for core_share in shares:
        core_share.close()


def test_workers_get_the_least_used_cores_as_homes(node):
    a, b, c = node(), node(), node()
    assert (a.home, b.home, c.home) == ((0,), (1,), (0,))
    a.close()
    d = node(home_threads=2)
    assert d.home == (0, 1)


def test_a_dead_workers_home_is_free_again(node, tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / "homes.json").write_text(json.dumps({f"{int(dead.stdout)}-1": [0]}))
    assert node().home == (0,)


def test_an_exited_but_unreaped_workers_home_is_free_again(node, tmp_path):
    zombie = subprocess.Popen(
        [sys.executable, "-c", "pass"]
    )  # not waited for: a zombie once it exits
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (tmp_path / "homes.json").write_text(json.dumps({f"{zombie.pid}-1": [0]}))
        assert node().home == (0,)
    finally:
        zombie.wait()


def test_a_prefill_step_borrows_an_idle_workers_core_and_gives_it_back(node):
    a, b = node(), node()
    a.busy()
    with a.step(is_prefill=True) as between_layers:
        assert a.threads == 2 and between_layers is not None
        with b.step(is_prefill=True) as nothing:  # the core is lent: b cannot borrow a's
            assert b.threads == 1 and nothing is None
    assert a.calls == [2, 1] and a.threads == 1
    assert a.borrowed_steps == 1
    with a.step(is_prefill=False):  # decode steps keep their home threads under "prefill"
        assert a.threads == 1


def test_all_lends_to_decode_steps_and_off_to_none(node):
    a, _ = node(lend="all"), node()
    with a.step(is_prefill=False):
        assert a.threads == 2
    c, _ = node(lend="off"), node()
    with c.step(is_prefill=True):
        assert c.threads == 1


def test_a_busy_worker_lends_nothing(node):
    a, b = node(), node()
    b.busy()
    with a.step(is_prefill=True):
        assert a.threads == 1
    b.idle()
    with a.step(is_prefill=True):
        assert a.threads == 2


def test_cores_no_worker_was_granted_are_never_borrowed(node):
    alone = node(num_cores=4)
    with alone.step(is_prefill=True):
        assert alone.threads == 1


def test_an_owner_gets_its_core_back_at_the_borrowers_next_layer_and_it_is_not_lent_again(node):
    a, b = node(), node()
    became_busy = threading.Event()

    def owner():
        b.busy()
        became_busy.set()

    with a.step(is_prefill=True) as between_layers:
        assert a.threads == 2
        waiting = threading.Thread(target=owner)
        waiting.start()
        time.sleep(0.1)
        assert not became_busy.is_set()  # a layer still runs on b's core
        between_layers()  # the next layer boundary: a drops to its home thread, then frees the core
        assert a.calls == [2, 1] and a.threads == 1
        assert became_busy.wait(5)
        waiting.join()
        between_layers()  # nothing left to hand back
    assert a.calls == [2, 1] and a.threads == 1  # nothing left to give back at the end
    assert b.owner_waits_s >= 0.1
    with a.step(is_prefill=True):
        assert a.threads == 1


def test_a_layer_boundary_keeps_a_core_nobody_wants(node):
    a, _ = node(), node()
    with a.step(is_prefill=True) as between_layers:
        between_layers()
        assert a.threads == 2


def test_a_borrower_that_stopped_holds_an_owner_no_longer_than_its_wait_and_gets_no_more(
    node, caplog
):
    a, b = node(), node(owner_wait_s=0.2)
    with a.step(is_prefill=True):  # never reaches a layer boundary: stopped
        started = time.monotonic()
        b.busy()
        assert 0.2 <= time.monotonic() - started < 2
        assert "still lent" in caplog.text
    # b computes on its core without its lock: a must not take it again
    with a.step(is_prefill=True):
        assert a.threads == 1
    b.busy()  # the next step takes it back
    b.idle()
    with a.step(is_prefill=True):
        assert a.threads == 2


def test_a_worker_sharing_its_home_core_never_borrows_but_lends(node):
    a, b, c = node(), node(), node()  # a and c share core 0
    with a.step(is_prefill=True):
        assert a.threads == 1  # c may be computing on core 0 already
    with b.step(is_prefill=True):
        assert b.threads == 2  # a and c idle: core 0 is free
    c.busy()
    with b.step(is_prefill=True):
        assert b.threads == 1


def test_the_policy_is_checked():
    with pytest.raises(ValueError, match="--lend-cores"):
        CorePolicy("sometimes")
    assert str(CorePolicy().path).endswith(f"pdserve-cores-{os.getuid()}")


def test_a_decoding_worker_lends_its_core_to_an_asking_prefill_within_its_slack_and_gets_it_back(
    node,
):
    """Sharing by the SLO: a prefill step asks for a busy worker's core; the busy worker, between
    two decode steps, lends it for at most its streams' slack; the prefill takes it at its next
    layer and hands it back at the one after the owner wants it."""
    prefill, decoder = node(lend="all", tpot_budget_s=0.05), node(lend="all", tpot_budget_s=0.05)
    decoder.busy()
    assert decoder.lend_within(1.0) == 0.0  # nobody asks
    with prefill.step(is_prefill=True) as between_layers:
        assert prefill.threads == 1 and between_layers is not None  # asking
        assert decoder.lend_within(0.001) == 0.0  # too little slack to be worth a pause
        lending = threading.Thread(target=decoder.lend_within, args=(1.0,))
        lending.start()
        deadline = time.monotonic() + 5
        while prefill.threads == 1:  # the next layer boundary takes the lent core
            assert time.monotonic() < deadline, "the lent core was never taken"
            time.sleep(0.005)
            between_layers()
        assert prefill.borrowed_steps == 1
        # the owner's pause ends (at most max_pause_tpot budgets: 0.2 s); it wants its core
        time.sleep(0.35)
        between_layers()
        assert prefill.threads == 1
        lending.join(5)
        assert not lending.is_alive()
    assert decoder.lent_pauses == 1 and 0.2 <= decoder.lent_pauses_s < 1.0
    assert prefill.calls == [2, 1]


def test_a_prefill_step_waits_briefly_for_a_core_lent_at_once_and_starts_on_it(node):
    """A decoding owner looks at every layer boundary, so a lend comes within a millisecond or so;
    a prefill step that asks waits up to `ask_wait_s` for it and runs its first layer on both
    cores. An owner that does not lend costs it that wait only."""
    prefill = node(lend="all", tpot_budget_s=0.05, ask_wait_s=2.0)
    decoder = node(lend="all", tpot_budget_s=0.05)
    decoder.busy()

    def lend_when_asked():
        deadline = time.monotonic() + 5
        while not decoder.asked() and time.monotonic() < deadline:
            time.sleep(0.001)
        decoder.lend_within(1.0)

    lending = threading.Thread(target=lend_when_asked)
    lending.start()
    with prefill.step(is_prefill=True):
        assert prefill.threads == 2 and prefill.calls == [2]
    lending.join(5)
    assert not lending.is_alive() and decoder.lent_pauses == 1
    prefill.close()  # its home core goes to the next one
    waiting = node(lend="all", tpot_budget_s=0.05, ask_wait_s=0.05)
    started = time.monotonic()
    with waiting.step(is_prefill=True):
        assert waiting.threads == 1  # the decoder is busy and lends nothing
    assert 0.05 <= time.monotonic() - started < 2


def test_a_pause_ends_when_the_prefill_step_ends_and_no_budget_means_no_pause(node):
    prefill, decoder = node(lend="all", tpot_budget_s=0.5), node(lend="all", tpot_budget_s=0.5)
    decoder.busy()
    with prefill.step(is_prefill=True):
        lending = threading.Thread(target=decoder.lend_within, args=(10.0,))
        lending.start()
        time.sleep(0.05)
    # nobody asks any more: the owner takes its core back long before its slack is spent
    lending.join(5)
    assert not lending.is_alive() and decoder.lent_pauses_s < 0.5
    prefill.close()
    decoder.close()
    plain, busy = node(lend="all"), node(lend="all")
    assert {plain.home, busy.home} == {(0,), (1,)}
    busy.busy()
    with plain.step(is_prefill=True) as between_layers:
        # no TPOT budget: only idle cores lent
        assert between_layers is None and busy.lend_within(10.0) == 0.0


def test_the_slack_is_what_the_tightest_stream_that_can_still_meet_the_budget_can_spare():
    policy = CorePolicy(tpot_budget_s=0.05, tpot_share=0.75)
    step_s = 0.03
    # runs to 74 tokens (64 more), 65 steps to go: 0.75 * 0.05 * 74 - 0.3 - 65 * 0.03 = 0.525 s
    young = StreamProgress(output_tokens=10, max_tokens=100, decoding_s=0.3)
    # 5 steps to its max_tokens: 0.75 * 0.05 * 64 - 1.6 - 5 * 0.03 = 0.65 s
    old = StreamProgress(output_tokens=60, max_tokens=64, decoding_s=1.6)
    # behind its share (0.0375 * 74 - 1.0 - 1.95 < 0) but within the budget (3.7 - 2.95 > 0): no
    # lending
    behind = StreamProgress(output_tokens=10, max_tokens=100, decoding_s=1.0)
    # misses the budget whatever happens (3.7 - 2.0 - 1.95 < 0): holds nothing back
    late = StreamProgress(output_tokens=10, max_tokens=100, decoding_s=2.0)

    def slack(*streams):
        return decode_slack_s(list(streams), step_s, policy)

    assert slack(young) == pytest.approx(0.525)
    assert slack(old) == pytest.approx(0.65)
    assert slack(young, old, late) == pytest.approx(0.525)
    assert slack(young, behind) < 0
    assert slack(late) is None  # every stream misses: the worker is overloaded, its cores decode
    assert decode_slack_s([young], step_s, CorePolicy()) is None  # no budget
