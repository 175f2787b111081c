"""Admission policies (planner and fifo) on the H200 cost model, and the trial pool they take from."""

from __future__ import annotations

import threading
import time

import pytest

from plora_hpo.adapter import AdapterConfig
from plora_hpo.admission import Candidate, FifoAdmission, PlannerAdmission, Room, make_admission
from plora_hpo.planner import CostModel, GpuSpec, Workload, resolve_model
from plora_hpo.trials import PoolClosed, TrialPool, TrialRequest, TrialTicket, TrialWithdrawn

GIB = 2**30
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def cost_model():
    _, shape = resolve_model("qwen2.5-1.5b")
    return CostModel(Workload(shape, 512, ("q_proj", "k_proj", "v_proj", "o_proj")), GpuSpec("NVIDIA H200", 141.0))


def cfg(rank=16, batch=2, lr=2e-4, seed=0):
    return AdapterConfig(rank, float(rank), lr, batch, seed=seed)


def room(cost_model, members=(), slots=32, gib=None, idle_peers=0):
    limit = 0.9 * 141.0 * GIB if gib is None else gib * GIB
    return Room(
        members=tuple(members), free_slots=slots, memory_limit=limit, cost_model=cost_model, idle_peers=idle_peers
    )


def test_make_admission_names_the_policy():
    assert isinstance(make_admission("planner"), PlannerAdmission)
    assert isinstance(make_admission("fifo"), FifoAdmission)


def test_fifo_takes_arrival_order_up_to_the_free_slots(cost_model):
    waiting = [Candidate(cfg(seed=i), 10) for i in range(6)]
    assert FifoAdmission().select(waiting, room(cost_model, slots=4)) == [0, 1, 2, 3]


def test_fifo_stops_at_the_first_trial_that_does_not_fit(cost_model):
    small, big = cfg(batch=2), cfg(batch=32)
    limit = cost_model.peak_memory([small, small]) / GIB * 1.001
    waiting = [Candidate(small, 10), Candidate(big, 10), Candidate(small, 10)]
    # the big one blocks the queue: fifo never overtakes it, even though the last small one fits
    assert FifoAdmission().select(waiting, room(cost_model, [], gib=limit)) == [0]


def test_an_empty_pack_always_gets_a_trial_even_one_predicted_not_to_fit(cost_model):
    waiting = [Candidate(cfg(batch=32, rank=128), 10)]
    tiny = room(cost_model, gib=1.0)
    assert FifoAdmission().select(waiting, tiny) == [0]
    assert PlannerAdmission().select(waiting, tiny) == [0]
    # with members training, a trial that does not fit waits instead
    assert PlannerAdmission().select(waiting, room(cost_model, [cfg()], gib=1.0)) == []


def test_planner_refills_the_memory_that_fifo_leaves_idle(cost_model):
    """A big member trains; the queue holds another big trial, then small ones. fifo waits for
    the big one to fit (no overtaking) and leaves the room idle; the planner fills it."""
    big, small = cfg(rank=128, batch=16), cfg(rank=8, batch=2)
    waiting = [Candidate(big, 100)] + [Candidate(small, 100) for _ in range(12)]
    limit = cost_model.peak_memory([big] + [small] * 4) / GIB * 1.001  # room for four small ones
    r = room(cost_model, [big], gib=limit)
    assert FifoAdmission().select(waiting, r) == []
    planned = PlannerAdmission().select(waiting, r)
    assert planned == [1, 2, 3, 4]  # the four earliest small ones
    assert r.fits([waiting[i].config for i in planned])


def test_planner_starts_the_longest_running_trials_first(cost_model):
    waiting = [Candidate(cfg(seed=i), steps) for i, steps in enumerate([10, 50, 10, 50, 10])]
    chosen = PlannerAdmission().select(waiting, room(cost_model, slots=2))
    assert sorted(chosen) == [1, 3]


def test_planner_counts_members_against_memory_and_slots(cost_model):
    small = cfg(rank=8, batch=4)
    limit = cost_model.peak_memory([small] * 4) / GIB * 1.001
    waiting = [Candidate(cfg(rank=8, batch=4, seed=i), 20) for i in range(10)]
    alone = PlannerAdmission().select(waiting, room(cost_model, gib=limit, slots=10))
    assert len(alone) == 4
    with_members = PlannerAdmission().select(waiting, room(cost_model, [small, small], gib=limit, slots=8))
    assert len(with_members) == 2
    assert PlannerAdmission().select(waiting, room(cost_model, [small], slots=1)) == [0]


def test_planner_says_which_solver_ran_and_plans_120_trials_within_a_second(cost_model):
    grid = [
        (r, m * r, lr, b)
        for r in (8, 16, 32, 64, 128)
        for m in (0.25, 1, 4)
        for lr in (2e-5, 1e-4, 2e-4, 4e-4)
        for b in (2, 8)
    ]  # paper120
    configs = [AdapterConfig(r, a, lr, b, seed=i) for i, (r, a, lr, b) in enumerate(grid)]
    waiting = [Candidate(c, 600 // c.batch_size) for c in configs]
    assert len(waiting) == 120
    policy = PlannerAdmission()
    started = time.perf_counter()
    chosen = policy.select(waiting, room(cost_model, slots=32))
    assert time.perf_counter() - started < 1.0
    assert 0 < len(chosen) <= 32
    assert policy.last is not None and ("HiGHS" in policy.last.solver or "gurobi" in policy.last.solver.lower())


def test_on_one_device_the_trials_the_ilp_defers_join_the_pack_while_they_fit():
    """Short sequences: the ILP's most tokens-per-second pack leaves the small-batch trials out;
    a later wave would pay the per-step fixed cost again for them, so they join now."""
    _, shape = resolve_model("qwen2.5-1.5b")
    short = CostModel(Workload(shape, 128, TARGETS), GpuSpec("NVIDIA H200", 141.0))
    configs = [
        AdapterConfig(r, m * r, lr, b, seed=i)
        for i, (r, m, lr, b) in enumerate(
            (r, m, lr, b) for r in (8, 16) for m in (0.25, 1, 4) for lr in (2e-5, 1e-4, 2e-4, 4e-4) for b in (2, 8)
        )
    ][:32]
    waiting = [Candidate(c, 150) for c in configs]
    assert short.peak_memory(configs) < 0.5 * 141.0 * GIB  # everything fits with room to spare
    chosen = PlannerAdmission().select(waiting, room(short, slots=32))
    assert chosen == list(range(32))
    # with fewer slots than trials, the slots bound the pack
    assert len(PlannerAdmission().select(waiting, room(short, slots=20))) == 20


# --- the pool -----------------------------------------------------------------------------------
def ticket(n):
    return TrialTicket(TrialRequest("synthetic", n, cfg(seed=n)))


def test_pool_take_removes_exactly_what_was_chosen_and_counts_changes():
    pool = TrialPool()
    for n in range(4):
        pool.put(ticket(n))
    version = pool.version
    taken = pool.take(lambda waiting: ([3, 1], []))
    assert [t.request.number for t in taken] == [3, 1]
    assert pool.version == version + 1
    assert [t.request.number for t in pool.take(lambda w: (range(len(w)), []))] == [0, 2]
    assert pool.take(lambda w: ([0], [])) == []


def test_a_named_waiting_ticket_is_taken_once_and_the_snapshot_keeps_the_order():
    pool = TrialPool()
    tickets = [ticket(n) for n in range(3)]
    for t in tickets:
        pool.put(t)
    assert pool.waiting() == tickets
    assert pool.take_ticket(tickets[1]) and pool.waiting() == [tickets[0], tickets[2]]
    assert not pool.take_ticket(tickets[1])  # gone: another worker would find it taken
    pool.close()
    with pytest.raises(PoolClosed):
        pool.take_ticket(tickets[0])


def test_a_withdrawn_waiting_ticket_leaves_the_pool_at_once_and_a_taken_one_is_only_marked():
    pool = TrialPool()
    tickets = [ticket(n) for n in range(3)]
    for t in tickets:
        pool.put(t)
    [taken] = pool.take(lambda waiting: ([0], []))  # a worker holds it now
    version = pool.version
    pool.withdraw(tickets[1], "another process set trial 1 FAIL")
    assert pool.waiting() == [tickets[2]] and pool.version == version + 1
    with pytest.raises(TrialWithdrawn, match="another process set trial 1 FAIL"):
        tickets[1].wait()
    pool.withdraw(taken, "another process set trial 0 FAIL")
    assert taken.withdrawn == "another process set trial 0 FAIL" and not taken.done(0)  # its worker lets it go
    assert tickets[2].withdrawn is None and pool.version == version + 1


def test_two_workers_never_take_one_trial():
    pool = TrialPool()
    for n in range(200):
        pool.put(ticket(n))
    got: list[list[int]] = [[], []]

    def worker(i):
        while True:
            taken = pool.take(lambda w: ([0] if w else [], []))
            if not taken:
                return
            got[i].append(taken[0].request.number)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got[0] + got[1]) == list(range(200))


def test_pool_wait_gathers_until_enough_wait_or_the_timeout_and_close_wakes_it():
    pool = TrialPool()
    pool.put(ticket(0))
    started = time.monotonic()
    assert pool.wait(at_least=3, timeout=0.2) == 1
    assert time.monotonic() - started >= 0.2
    threading.Timer(0.1, lambda: [pool.put(ticket(n)) for n in (1, 2)]).start()
    assert pool.wait(at_least=3, timeout=5) == 3
    threading.Timer(0.1, pool.close).start()
    with pytest.raises(PoolClosed):
        pool.wait(at_least=10)


def test_closing_the_pool_hands_back_the_waiting_and_refuses_new_ones():
    pool = TrialPool()
    pool.put(ticket(0))
    assert [t.request.number for t in pool.close()] == [0]
    late = ticket(1)
    pool.put(late)
    with pytest.raises(Exception, match="stopped before it started"):
        late.wait()
    with pytest.raises(PoolClosed):
        pool.take(lambda w: ([0], []))


def test_fair_share_splits_the_pool_among_idle_devices():
    from plora_hpo.admission import fair_share

    assert fair_share(32, 120, 7) == 15  # eight devices start at once: 15 trials each
    assert fair_share(32, 120, 0) == 32  # alone: the pack size decides
    assert fair_share(4, 3, 3) == 1
    assert fair_share(32, 0, 3) == 0


def test_pool_counts_the_workers_waiting_for_trials():
    pool = TrialPool()
    threads = [threading.Thread(target=pool.wait, kwargs={"timeout": 5}) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while pool.idle_workers < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.idle_workers == 3
    pool.put(ticket(0))
    for t in threads:
        t.join()
    assert pool.idle_workers == 0 and pool.wait(timeout=0) == 1


def test_a_plan_for_idle_workers_reserves_their_packs_until_claimed():
    pool = TrialPool()
    for n in range(6):
        pool.put(ticket(n))
    mine = pool.take(lambda w: ([0, 1], [[2, 3], [4]]))
    assert [t.request.number for t in mine] == [0, 1]
    assert pool.wait(at_least=5, timeout=0) == 1  # one waits; a reservation wakes an idle worker at once
    assert [t.request.number for t in pool.claim()] == [2, 3]
    assert [t.request.number for t in pool.claim()] == [4]
    assert pool.claim() == []
    pool.take(lambda w: ([], [[0]]))
    assert [t.request.number for t in pool.close()] == [5]  # reserved ones are handed back on close


def test_planner_plans_one_pack_per_idle_device_and_leaves_the_others_for_them(cost_model):
    waiting = [Candidate(cfg(rank=r, batch=b, seed=i), 600 // b) for i, (r, b) in enumerate([(8, 2), (64, 8)] * 12)]
    policy = PlannerAdmission()
    mine = policy.select(waiting, room(cost_model, slots=32, idle_peers=3))
    packs = [mine, *policy.last.peer_packs]
    assert 2 <= len(packs) <= 4 and all(packs)
    flat = [i for p in packs for i in p]
    assert len(flat) == len(set(flat))  # no trial in two devices' packs (the rest wait for later packs)
    assert "job planner over 4 idle devices" in policy.last.solver


def test_a_plan_for_idle_devices_leaves_no_trial_waiting_that_a_starting_pack_fits(cost_model):
    """The job planner times a pack as if all members ran to the longest one's end, and defers
    trials under that view; a sweep's members leave early, so a deferred trial that fits a
    starting pack joins the one that then ends earliest instead of running alone later."""
    kinds = [(8, 2, 4276), (16, 2, 4276), (32, 8, 1069), (64, 8, 1069), (128, 8, 1069)]
    waiting = [Candidate(cfg(rank=r, batch=b, seed=i), s) for i, (r, b, s) in enumerate(kinds * 12)]
    r = room(cost_model, slots=32, idle_peers=7)
    policy = PlannerAdmission()
    packs = [policy.select(waiting, r), *policy.last.peer_packs]
    flat = [i for p in packs for i in p]
    assert len(flat) == len(set(flat))
    for i in set(range(len(waiting))) - set(flat):  # what still waits fits no starting pack
        assert all(len(p) >= 32 or not r.fits([waiting[k].config for k in [*p, i]]) for p in packs)
    assert all(r.fits([waiting[k].config for k in p]) for p in packs)


@pytest.mark.parametrize("policy", [FifoAdmission, PlannerAdmission])
def test_a_tensor_parallel_group_admits_by_its_per_gpu_memory(policy):
    """Each GPU of a degree-2 group holds half the projections and adapters' split factors: a
    limit that holds a few adapters on one GPU holds more on each GPU of the group."""
    _, shape = resolve_model("qwen2.5-7b")
    cm = CostModel(Workload(shape, 512, TARGETS), GpuSpec("NVIDIA H200", 141.0))
    big = cfg(rank=64, batch=8)
    waiting = [Candidate(AdapterConfig(64, 64.0, 2e-4, 8, seed=i), 100) for i in range(16)]
    limit = cm.peak_memory([big] * 4) * 1.001
    one = Room(members=(), free_slots=16, memory_limit=limit, cost_model=cm)
    two = Room(members=(), free_slots=16, memory_limit=limit, cost_model=cm, degree=2)
    alone, split = policy().select(waiting, one), policy().select(waiting, two)
    assert len(alone) == 4
    assert len(split) > len(alone)
    assert cm.peak_memory([w.config for w in waiting][: len(split)], 2) <= limit
