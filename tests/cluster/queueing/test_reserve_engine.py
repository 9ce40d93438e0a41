"""The engine's shortcuts change no decision: the same runs with them off give the same decisions.

Compared, in whole runs of the engine with several reservations, notices and requeued
victims: the fast search for reservations (earliest.py) against the plain one, and
passing over a one-pod job whose smaller sibling failed at the same epoch, or whose last
failure no node freed since can change (admit.py, freed.py), or, when no waiting reasons
are read, whose shape is larger than one that failed in the cycle (admit.Larger), against
trying it.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing.admit import Larger
from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.queueing.presets import preset
from gpunode.placement.frag import TargetPod, TargetWorkload
from gpunode.placement.model import Request
from tests.cluster.queueing.sched_helpers import config, node

WORKLOAD = TargetWorkload(
    (
        TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=1, gpu_models=None, weight=3),
        TargetPod(cpu_milli=0, gpu_milli=500, gpus=1, gpu_models=None, weight=1),
    )
)


class Plain(Scheduler):
    """The scheduler with every trial made and reservations found by the plain search."""

    fast_reserve = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fail_marks = _Forgets()
        self._larger = _NoLarger()

    def _smaller_failed(self, *args: Any) -> bool:
        return False


class _NoLarger(Larger):
    """No shape is known to be larger than another: the walk tries every job of a shape not yet failed."""

    def of(self, shape: int) -> None:
        return None


class _Forgets(dict[Any, Any]):
    """A dict that keeps nothing: no failure is remembered, so every one-pod job is planned."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


request = st.one_of(
    st.builds(
        Request, gpus=st.sampled_from([1, 1, 2, 4, 8]), cpu_milli=st.sampled_from([0, 4000, 8000, 64000])
    ),
    st.builds(
        Request, gpu_milli=st.sampled_from([300, 500, 700]), cpu_milli=st.sampled_from([0, 2000, 4000])
    ),
)
spec = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    request,
    st.sampled_from([1, 1, 1, 2]),  # pods
    st.integers(0, 10),  # arrival
    st.integers(1, 60),  # runtime
    st.sampled_from([None, 0.5, 1.0, 2.0]),  # estimate as a multiple of the runtime (None: the default)
    st.sampled_from([0, 0, 1]),  # priority
)


def run(
    cls: type[Scheduler], specs: list[Any], nodes: int, reservations: int, policy: str, explain: bool = True
) -> list[Any]:
    """Drive one scheduler through the arrivals; every decision and waiting reason, cycle by cycle."""
    queues = [{"name": q, "guarantee": {"gpu": 4}} for q in ("a", "b", "c")]
    cfg = config(queues, backfill={"reservations": reservations, "reservedShare": 1, "defaultRuntime": "30s"},
                 preemption={"notice": "5s", "minRuntime": "0s"})  # fmt: skip
    cap = ClusterCapacity([node(f"n{i}", 4) for i in range(nodes)], policy=policy, seed=3,
                          workload=WORKLOAD, energy_weight=0.5 if policy == "gpunode" else 0.0)  # fmt: skip
    s = cls(cfg, cap, preset("gpunode"))
    s.report_waiting = explain
    arrivals = sorted((t, f"j{i}", q, r, p, rt, est, pr) for i, (q, r, p, t, rt, est, pr) in enumerate(specs))
    ends: dict[str, float] = {}
    runtime: dict[str, int] = {}
    out: list[Any] = []
    k = 0
    for _ in range(2000):
        times = [*ends.values(), *([float(arrivals[k][0])] if k < len(arrivals) else [])]
        deadline = s.next_deadline()
        if deadline is not None:
            times.append(deadline)
        if not times:
            break
        now = min(times)
        for name in sorted(n for n, t in ends.items() if t <= now):
            del ends[name]
            s.finished(name, now)
        while k < len(arrivals) and arrivals[k][0] <= now:
            t, name, q, r, pods, rt, est, pr = arrivals[k]
            runtime[name] = rt
            estimate = None if est is None else rt * est
            s.submit(Job(name, q, (r,) * pods, float(t), priority=pr, runtime_estimate=estimate), now)
            k += 1
        d = s.cycle(now)
        for adm in d.admit:
            ends[adm.job.name] = now + runtime[adm.job.name]
        for name in d.kill:
            ends.pop(name, None)
        out.append(
            (
                now,
                [(a.job.name, a.plan) for a in d.admit],
                d.notices,
                d.kill,
                d.waiting,
                sorted(s.reservations.items()),
            )
        )
    return out


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(spec, min_size=20, max_size=60),
    nodes=st.integers(2, 4),
    reservations=st.sampled_from([1, 4, 8]),
    policy=st.sampled_from(["gpunode", "bestfit", "random"]),
    explain=st.booleans(),
)
def test_the_shortcuts_change_no_decision(
    specs: list[Any], nodes: int, reservations: int, policy: str, explain: bool
) -> None:
    assert run(Scheduler, specs, nodes, reservations, policy, explain) == run(
        Plain, specs, nodes, reservations, policy, explain
    )
