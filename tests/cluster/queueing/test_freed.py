"""ClusterCapacity.still_fails: a one-pod plan said to fail for sure does fail (freed.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.freed import KEEP, FreedLog
from gpunode.cluster.queueing.model import Job, Plan
from gpunode.placement.model import Request
from tests.cluster.queueing.sched_helpers import node

requests = st.one_of(
    st.builds(Request, gpus=st.sampled_from([1, 2]), cpu_milli=st.sampled_from([0, 8000, 64000])),
    st.builds(Request, gpu_milli=st.sampled_from([300, 500, 700]), cpu_milli=st.sampled_from([0, 4000])),
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), requests),
        st.tuples(st.just("release"), st.integers(0, 100)),
        st.tuples(st.just("check"), requests, st.sampled_from([(), (), ("n0",), ("n1",)])),
        st.tuples(st.just("trial"), requests),
    ),
    min_size=5,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_a_plan_said_to_fail_fails(script: list[tuple[object, ...]]) -> None:
    cap = ClusterCapacity([node(f"n{i}", gpus=2) for i in range(3)], policy="bestfit", seed=1)
    held: list[str] = []
    failures: list[tuple[Request, frozenset[str], tuple[object, int]]] = []
    for n, step in enumerate(script):
        if step[0] == "commit" or step[0] == "trial":
            job = Job(name=f"j{n}", queue="a", pods=(step[1],), arrival=0.0)  # type: ignore[arg-type]
            plan = cap.plan(job)
            if plan is None:
                continue
            if step[0] == "commit":
                cap.commit(job.name, job, plan)
                held.append(job.name)
            else:  # a what-if that commits and is undone: the nodes it filled get their room back
                with cap.trial():
                    cap.commit(job.name, job, plan)
        elif step[0] == "release" and held:
            cap.release(held.pop(int(step[1]) % len(held)))  # type: ignore[call-overload]
        elif step[0] == "check":
            pod, exclude = step[1], frozenset(step[2])  # type: ignore[arg-type]
            probe = Job(name="probe", queue="a", pods=(pod,), arrival=0.0)  # type: ignore[arg-type]
            for f_pod, f_exclude, mark in failures:
                if cap.still_fails(f_pod, f_exclude, mark):
                    assert (
                        cap.plan(
                            Job(name="again", queue="a", pods=(f_pod,), arrival=0.0), exclude_nodes=f_exclude
                        )
                        is None
                    )
            if cap.plan(probe, exclude_nodes=exclude) is None:
                failures.append((pod, exclude, cap.freed_mark()))  # type: ignore[arg-type]


def test_a_failure_holds_until_a_node_that_fits_gains_room() -> None:
    cap = ClusterCapacity([node("n0", gpus=2), node("n1", gpus=1)], policy="bestfit", seed=1)
    two = Request(gpus=2)
    cap.commit("big", Job(name="big", queue="a", pods=(two,), arrival=0.0), _plan(cap, two))
    assert cap.plan(Job(name="p", queue="a", pods=(two,), arrival=0.0)) is None
    mark = cap.freed_mark()
    assert cap.still_fails(two, frozenset(), mark)
    cap.commit(
        "small",
        Job(name="small", queue="a", pods=(Request(gpus=1),), arrival=0.0),
        _plan(cap, Request(gpus=1)),
    )
    cap.release("small")  # n1 gained room, but two GPUs never fit it
    assert cap.still_fails(two, frozenset(), mark)
    cap.release("big")  # n0 did: the plan is made again, and succeeds
    assert not cap.still_fails(two, frozenset(), mark)
    assert cap.still_fails(two, frozenset({"n0"}), mark)  # unless n0 is kept off
    assert cap.plan(Job(name="p", queue="a", pods=(two,), arrival=0.0)) is not None


def _plan(cap: ClusterCapacity, pod: Request) -> Plan:
    plan = cap.plan(Job(name="x", queue="a", pods=(pod,), arrival=0.0))
    assert plan is not None
    return plan


def test_a_fork_and_an_old_mark_are_not_known() -> None:
    cap = ClusterCapacity([node("n0", gpus=1)], policy="bestfit", seed=1)
    big = Request(gpus=2)
    mark = cap.freed_mark()
    assert cap.still_fails(big, frozenset(), mark)  # nothing freed since, and it did not fit
    assert not cap.fork().still_fails(big, frozenset(), mark)  # another history: plan it
    log = FreedLog()
    old = log.mark()
    for _ in range(2 * KEEP):
        log.add(__import__("numpy").array([0]))
    assert log.since(old, limit=10**9) is None and log.since(log.mark(), limit=1) is not None
