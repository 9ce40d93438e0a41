"""admit.py's shortcut: a one-pod job whose smaller sibling failed at this epoch fails too."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing.admit import _family
from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.model import Job
from gpunode.placement.model import Request
from tests.cluster.queueing.test_earliest import WORKLOAD, node

whole = st.builds(
    Request,
    gpus=st.integers(1, 4),
    cpu_milli=st.sampled_from([0, 2000, 8000, 32000]),
    memory_bytes=st.sampled_from([0, 8 << 30, 48 << 30]),
)
fraction = st.builds(
    Request,
    gpu_milli=st.sampled_from([0, 200, 500, 800]),
    gpu_memory_bytes=st.sampled_from([0, 4 << 30, 12 << 30]),
    cpu_milli=st.sampled_from([0, 2000, 8000]),
).filter(lambda q: q.kind == "fraction")
pod = st.one_of(whole, fraction, st.builds(Request, cpu_milli=st.sampled_from([1000, 16000])))


def grown(q: Request, extra: tuple[int, int, int, int, int]) -> Request:
    """q asking for at least as much of everything (the same kind)."""
    gpus, milli, gmem, cpu, mem = extra
    if q.kind == "whole":
        return Request(gpus=q.gpus + gpus, cpu_milli=q.cpu_milli + cpu, memory_bytes=q.memory_bytes + mem)
    if q.kind == "fraction":
        return Request(
            gpu_milli=min(q.gpu_milli + milli, 999) if q.gpu_milli else 0,
            gpu_memory_bytes=q.gpu_memory_bytes + gmem,
            cpu_milli=q.cpu_milli + cpu,
            memory_bytes=q.memory_bytes + mem,
        )
    return Request(cpu_milli=q.cpu_milli + cpu, memory_bytes=q.memory_bytes + mem)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(
        st.tuples(
            st.sampled_from([1, 2, 4, 8]), st.sampled_from([8, 16, 64]), st.sampled_from(["T4", "V100"])
        ),
        min_size=1,
        max_size=4,
    ),
    held=st.lists(pod, max_size=20),
    small=pod,
    extra=st.tuples(
        st.integers(0, 2),
        st.sampled_from([0, 100, 400]),
        st.sampled_from([0, 2 << 30]),
        st.sampled_from([0, 1000, 8000]),
        st.sampled_from([0, 1 << 30]),
    ),
    excluded=st.tuples(st.sets(st.integers(0, 3), max_size=2), st.sets(st.integers(0, 3), max_size=2)),
    policy=st.sampled_from(["gpunode", "bestfit", "random"]),
)
def test_a_pod_that_fails_means_every_larger_one_of_its_family_fails(
    nodes: list[tuple[int, int, str]],
    held: list[Request],
    small: Request,
    extra: tuple[int, int, int, int, int],
    excluded: tuple[set[int], set[int]],
    policy: str,
) -> None:
    cap = ClusterCapacity(
        [node(f"n{i}", g, cpu, model) for i, (g, cpu, model) in enumerate(nodes)],
        policy=policy,
        workload=WORKLOAD,
        seed=1,
    )
    for i, q in enumerate(held):
        j = Job(name=f"h{i}", queue="q", pods=(q,), arrival=0.0)
        plan = cap.plan(j)
        if plan is not None:
            cap.commit(j.name, j, plan)
    large = grown(small, extra)
    assert _family(large) == _family(small)
    first = frozenset(f"n{i}" for i in excluded[0])
    more = first | {f"n{i}" for i in excluded[1]}
    if cap.plan(Job(name="s", queue="q", pods=(small,), arrival=0.0), exclude_nodes=first) is None:
        assert cap.plan(Job(name="l", queue="q", pods=(large,), arrival=0.0), exclude_nodes=more) is None
