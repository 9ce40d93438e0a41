"""EASY backfill: the reservation of the head-of-line job, and backfill that never delays it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing.backfill import Reservation, backfill_plan, reserve
from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.model import Job, Plan, RunningJob
from gpunode.placement.model import GpuState, NodeState, Request

DEFAULT = 30.0


def node(name: str, gpus: int) -> NodeState:
    """An empty node of fractional GPUs."""
    return NodeState(
        name=name,
        gpus=tuple(
            GpuState(
                uuid=f"{name}/gpu{j}",
                index=j,
                model="T4",
                milli_free=1000,
                memory_total_bytes=0,
                memory_free_bytes=0,
                numa_node=None,
            )
            for j in range(gpus)
        ),
        cpu_milli_free=64000,
        memory_free_bytes=1 << 40,
    )


def job(name: str, *pods: Request, estimate: float | None = None) -> Job:
    """A job of these pods."""
    return Job(name=name, queue="q", pods=pods, arrival=0.0, runtime_estimate=estimate)


def start(
    cap: ClusterCapacity, j: Job, t: float, nodes: frozenset[str] = frozenset(), plan: Plan | None = None
) -> RunningJob:
    """Commit j at time t with `plan` (default: a plan avoiding `nodes`); the running job."""
    plan = plan or cap.plan(j, exclude_nodes=nodes)
    assert plan is not None
    cap.commit(j.name, j, plan)
    return RunningJob(job=j, start=t, plan=plan, usage=cap.held(j.name))


def test_hand_worked_reservation_and_backfill() -> None:
    cap = ClusterCapacity([node("a", 4), node("b", 4)], policy="bestfit")
    a_job = start(cap, job("A", Request(gpus=4), estimate=100), 0.0, nodes=frozenset({"b"}))
    b_job = start(cap, job("B", Request(gpus=2), estimate=50), 0.0)
    assert a_job.plan.nodes == {"a"} and b_job.plan.nodes == {"b"}
    head = job("head", Request(gpus=4))
    res = reserve(head, [a_job, b_job], cap, now=10.0, default_runtime=DEFAULT)
    assert res is not None
    assert (res.start, res.nodes, res.job) == (50.0, frozenset({"b"}), "head")
    assert cap.plan(head) is None and cap.jobs == ("A", "B")  # reserve left cap as it was
    short = job("short", Request(gpus=2), estimate=40)  # ends at 50: may use b
    long = job("long", Request(gpus=2), estimate=41)  # ends at 51: only outside b, and a is full
    assert backfill_plan(long, res, cap, 10.0, DEFAULT) is None
    plan = backfill_plan(short, res, cap, 10.0, DEFAULT)
    assert plan is not None and plan.nodes == {"b"}


def test_a_job_past_its_estimate_is_expected_to_end_now() -> None:
    cap = ClusterCapacity([node("a", 2)], policy="bestfit")
    late = start(cap, job("late", Request(gpus=2), estimate=5), 0.0)
    res = reserve(job("head", Request(gpus=2)), [late], cap, now=100.0, default_runtime=DEFAULT)
    assert res is not None and res.start == 100.0


def test_default_runtime_is_used_without_an_estimate() -> None:
    cap = ClusterCapacity([node("a", 2)], policy="bestfit")
    r = start(cap, job("r", Request(gpus=2)), 5.0)
    res = reserve(job("head", Request(gpus=1)), [r], cap, now=6.0, default_runtime=DEFAULT)
    assert res is not None and res.start == 5.0 + DEFAULT


def test_no_reservation_when_the_head_never_fits() -> None:
    cap = ClusterCapacity([node("a", 2), node("b", 2)], policy="bestfit")
    r = start(cap, job("r", Request(gpus=1), estimate=10), 0.0)
    assert reserve(job("huge", Request(gpus=4)), [r], cap, 0.0, DEFAULT) is None
    # a job not in `running` is taken to run on for ever
    assert reserve(job("head", Request(gpus=2), Request(gpus=2)), [], cap, 0.0, DEFAULT) is None
    assert reserve(job("head", Request(gpus=2), Request(gpus=2)), [r], cap, 0.0, DEFAULT) is not None


def test_reserve_inside_a_trial_uses_a_fork() -> None:
    cap = ClusterCapacity([node("a", 2)], policy="bestfit")
    r = start(cap, job("r", Request(gpus=2), estimate=10), 0.0)
    with cap.trial():
        res = reserve(job("head", Request(gpus=2)), [r], cap, 0.0, DEFAULT)
        assert res is not None and res.start == 10.0
        assert cap.jobs == ("r",)


# ----- the property: backfill never delays the head's reservation (under the estimates) ----------------

pod = st.one_of(
    st.builds(Request, gpus=st.integers(1, 4)),
    st.builds(Request, gpu_milli=st.integers(1, 9).map(lambda x: x * 100)),
)
timed = st.tuples(st.lists(pod, min_size=1, max_size=3), st.integers(1, 60))


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4),
    running=st.lists(st.tuples(timed, st.integers(0, 40)), max_size=10),
    head=st.lists(st.builds(Request, gpus=st.integers(1, 8)), min_size=1, max_size=3),
    later=st.lists(timed, max_size=10),
    policy=st.sampled_from(["bestfit", "spread", "gpunode", "random"]),
    seed=st.integers(0, 3),
)
def test_backfill_never_delays_the_reservation(
    sizes: list[int],
    running: list[tuple[tuple[list[Request], int], int]],
    head: list[Request],
    later: list[tuple[list[Request], int]],
    policy: str,
    seed: int,
) -> None:
    from gpunode.placement.frag import TargetPod, TargetWorkload

    workload = TargetWorkload((TargetPod(cpu_milli=0, gpu_milli=1000, gpus=1, gpu_models=None, weight=1),))
    now = 50.0
    cap = ClusterCapacity([node(f"n{i}", g) for i, g in enumerate(sizes)], policy=policy, seed=seed,
                          workload=workload)  # fmt: skip
    jobs: list[RunningJob] = []
    for i, ((pods, est), age) in enumerate(running):
        j = job(f"r{i}", *pods, estimate=float(est))
        plan = cap.plan(j)
        if plan is not None:
            jobs.append(start(cap, j, now - age, plan=plan))
    head_job = job("head", *head)
    res = reserve(head_job, jobs, cap, now, DEFAULT)
    if not cap.fits_empty(head_job):
        assert res is None
        return
    assert res is not None and res.start >= now
    for i, (pods, est) in enumerate(later):
        j = job(f"b{i}", *pods, estimate=float(est))
        plan = backfill_plan(j, res, cap, now, DEFAULT)
        if plan is None:
            continue
        ends_in_time = now + est <= res.start
        assert ends_in_time or not (plan.nodes & res.nodes)
        cap.commit(j.name, j, plan)
        jobs.append(RunningJob(job=j, start=now, plan=plan, usage=cap.held(j.name)))
    again = reserve(head_job, jobs, cap, now, DEFAULT)
    assert again is not None and again.start <= res.start
    # at the reservation's start every job expected to have ended is gone: the reserved plan fits then
    cap.release_many([r.job.name for r in jobs if max(now, r.expected_end(DEFAULT)) <= res.start])
    cap.commit("head", head_job, res.plan)


def test_reservation_is_a_plain_record() -> None:
    cap = ClusterCapacity([node("a", 1)], policy="bestfit")
    res = reserve(job("h", Request(gpus=1)), [], cap, 3.0, DEFAULT)
    assert isinstance(res, Reservation) and res.start == 3.0 and res.nodes == {"a"}


# ----- the property in the engine: no reservation is delayed, however many are held -----------------------

engine_job = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 2),  # pods
    st.integers(0, 30),  # arrival
    st.integers(1, 60),  # runtime, exactly as estimated
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(engine_job, min_size=1, max_size=25),
    nodes=st.integers(2, 3),
    reservations=st.sampled_from([1, 2, 4]),
    per_queue=st.sampled_from([0, 1, 2]),
)
def test_with_exact_estimates_every_reserved_job_starts_by_its_reservation(
    specs: list[tuple[str, int, int, int, int]], nodes: int, reservations: int, per_queue: int
) -> None:
    from tests.cluster.queueing.sched_helpers import config, scheduler
    from tests.cluster.queueing.sched_helpers import job as queued

    queues = [{"name": q, "guarantee": {"gpu": 4}} for q in ("a", "b", "c")]
    cfg = config(queues, backfill={"reservations": reservations, "reservationsPerQueue": per_queue, "reservedShare": 1},
                 preemption={"reclaim": False, "priority": False})  # fmt: skip
    s = scheduler(cfg, nodes=nodes)
    arrivals = sorted((t, f"j{i}", q, g, p, rt) for i, (q, g, p, t, rt) in enumerate(specs))
    queue_of = {name: q for _, name, q, _, _, _ in arrivals}
    ends: dict[str, float] = {}
    promised: dict[str, float] = {}
    started: dict[str, float] = {}
    k = 0
    while k < len(arrivals) or ends:
        now = min([*ends.values(), *([float(arrivals[k][0])] if k < len(arrivals) else [])])
        while k < len(arrivals) and arrivals[k][0] <= now:
            t, name, q, g, p, rt = arrivals[k]
            s.submit(queued(name, q, g, pods=p, t=float(t), est=float(rt)), now)
            k += 1
        for name in [n for n, end in ends.items() if end <= now]:
            s.finished(name, now)
            del ends[name]
        d = s.cycle(now)
        for a in d.admit:
            started[a.job.name] = now
            ends[a.job.name] = now + (a.job.runtime_estimate or 0.0)
        held = s.reservations
        assert len(held) <= reservations
        head = s.reservation
        further = Counter(queue_of[n] for n in held if head is None or n != head[0])
        assert all(count <= per_queue for count in further.values()), further
        for name, res in held.items():
            promised.setdefault(name, res.start)
        if k == len(arrivals) and not ends:
            break
    assert s.pending_count == 0  # every job fits the empty cluster
    for name, start in promised.items():
        assert started[name] <= start, (name, started[name], start)


@pytest.mark.parametrize(
    ("remaining", "planned_end"), [(0.0, 190.0), (0.5, 225.0), (1.0, 200.0), (2.0, 300.0)]
)
def test_an_overdue_job_is_planned_to_run_on_for_a_share_of_what_it_has_run(
    remaining: float, planned_end: float
) -> None:
    """backfill.overdueRemaining: a job past its plan (100 s) is planned again, its runtime grown by
    1 + the share each time it is passed until it ends after now (at 190: 100 -> 150 -> 225 at 0.5,
    100 -> 200 at 1.0, 100 -> 300 at 2.0; at 0 it ends now), so the head's reservation starts then and
    a short job may run on its nodes until that start."""
    from tests.cluster.queueing.sched_helpers import config, names, scheduler
    from tests.cluster.queueing.sched_helpers import job as queued

    cfg = config([{"name": "a", "guarantee": {"gpu": 8}}], backfill={"overdueRemaining": remaining},
                 preemption={"reclaim": False, "priority": False})  # fmt: skip
    s = scheduler(cfg, nodes=1, gpus=8)
    s.submit(queued("old", "a", 4, est=100.0), 0.0)
    assert names(s.cycle(0.0).admit) == ["old"]
    s.submit(queued("head", "a", 8, t=190.0, est=1000.0), 190.0)
    assert names(s.cycle(190.0).admit) == []
    assert s.reservations["head"].start == planned_end
    s.submit(queued("short", "a", 4, t=200.0, est=20.0), 200.0)  # ends at 220
    assert names(s.cycle(200.0).admit) == ([] if planned_end < 220.0 else ["short"])
    s.finished("old", 230.0)
    assert names(s.cycle(230.0).admit) == ([] if planned_end >= 220.0 else ["head"])


@pytest.mark.parametrize(
    ("remaining", "start", "waits_for"), [(0.0, 190.0, "x"), (2.0, 300.0, "x"), (5.0, 400.0, "y")]
)
def test_a_job_planned_to_run_on_moves_in_the_order_of_expected_ends(
    remaining: float, start: float, waits_for: str
) -> None:
    """The reservation waits for the job that is planned to end first: x, past its plan of 100 s (planned
    again to 300 s at a share of 2, to 600 s at 5), or y, planned for 400 s; a controller that adopts both
    after a restart plans them with their estimates, and the reservation, the same way."""
    from tests.cluster.queueing.sched_helpers import config, names, scheduler
    from tests.cluster.queueing.sched_helpers import job as queued

    cfg = config([{"name": "a", "guarantee": {"gpu": 16}}], backfill={"overdueRemaining": remaining},
                 preemption={"reclaim": False, "priority": False})  # fmt: skip
    s = scheduler(cfg, nodes=2, gpus=8)
    for name, est in (("x", 100.0), ("y", 400.0)):
        s.submit(queued(name, "a", 8, est=est), 0.0)
    assert names(s.cycle(0.0).admit) == ["x", "y"]
    s.submit(queued("head", "a", 8, t=190.0, est=1000.0), 190.0)
    s.cycle(190.0)
    res = s.reservations["head"]
    assert (res.start, res.nodes) == (start, s.running[waits_for].plan.nodes)

    again = scheduler(cfg, nodes=2, gpus=8)  # a restart at 190: the running jobs adopted as they run
    for name in ("x", "y"):
        r = s.running[name]
        again.adopt(r.job, r.plan, r.start, 190.0)
    again.submit(queued("head", "a", 8, t=190.0, est=1000.0), 190.0)
    again.cycle(190.0)
    assert again.reservations["head"] == res
