"""WaitList, DeadShapes and Larger: the arrays stay in step with the list, the vectorised pass over jobs
stops exactly where the engine's one-by-one rule would, and the larger shapes are the right ones."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing.admit import Larger
from gpunode.cluster.queueing.rooms import ANY
from gpunode.cluster.queueing.waitlist import DeadShapes, WaitList
from gpunode.placement.model import Request


@dataclass
class Job:  # what WaitList reads of a Pending
    key: tuple[int, float, int]
    shape: int
    runtime: float


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(0, 5), st.integers(0, 7), st.sampled_from([60.0, 600.0, 3600.0])
        ),
        st.tuples(st.just("pop"), st.integers(0, 1000)),
        st.tuples(st.just("del"), st.integers(0, 1000)),
    ),
    max_size=120,
)


def _build(steps: list[tuple[object, ...]]) -> tuple[WaitList, list[Job]]:
    wl, plain = WaitList(), []
    for seq, step in enumerate(steps):
        if step[0] == "add":
            _, prio, shape, runtime = step
            job = Job(key=(-int(prio), float(seq % 7), seq), shape=int(shape), runtime=float(runtime))  # type: ignore[arg-type]
            wl.add(job)  # type: ignore[arg-type]
            bisect.insort(plain, job, key=lambda j: j.key)
        elif plain:
            i = int(step[1]) % len(plain)  # type: ignore[call-overload]
            if step[0] == "pop":
                assert wl.pop(i) is plain.pop(i)
            else:
                del wl[i]
                del plain[i]
    return wl, plain


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_arrays_follow_every_insert_pop_and_del(steps: list[tuple[object, ...]]) -> None:
    wl, plain = _build(steps)
    assert list(wl) == plain
    n = len(plain)
    assert wl._shapes[:n].tolist() == [j.shape for j in plain]
    assert wl._runtimes[:n].tolist() == [j.runtime for j in plain]
    for j in plain:
        assert wl[wl.index_of(j)] is j  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    ops,
    st.dictionaries(st.integers(0, 7), st.sampled_from([ANY, 500.0, 1000.0, 4000.0]), max_size=8),
    st.integers(0, 200),
    st.integers(0, 200),
)
def test_next_unskipped_stops_where_the_one_by_one_rule_would(
    steps: list[tuple[object, ...]], limits: dict[int, float], start: int, stop: int
) -> None:
    wl, plain = _build(steps)
    dead = DeadShapes(8)
    for shape, limit in limits.items():
        dead.set(shape, limit)
    now = 100.0
    start, stop = sorted((min(start, len(plain)), min(stop, len(plain))))  # the engine's start <= stop
    expected = start
    while expected < stop:
        job = plain[expected]
        limit = dead.get(job.shape)
        if limit is None or not now + job.runtime > limit:
            break
        expected += 1
    assert wl.next_unskipped(start, stop, now, dead) == expected


def test_forgetting_the_levels_keeps_the_level_0_failures() -> None:
    dead = DeadShapes(4)
    dead.set(0, ANY)
    dead.set(1, 700.0)
    dead.forget_levels(ANY)
    assert dead.get(0) == ANY and dead.get(1) is None
    assert dead.limits[0] == -math.inf and dead.limits[1] == math.inf
    grown = dead.grown(200)
    assert grown.covers(200) and grown.get(0) == ANY and grown.limits[0] == -math.inf


def test_lowering_marks_more_jobs_and_never_fewer() -> None:
    dead = DeadShapes(4)
    dead.set(1, 300.0)
    dead.lower(np.array([0, 1, 2]), 500.0)
    assert [dead.get(s) for s in range(4)] == [500.0, 300.0, 500.0, None]
    dead.lower(np.array([2]), ANY)
    assert dead.get(2) == ANY and dead.limit_of(3) == math.inf


def test_larger_shapes_are_those_of_the_family_asking_no_less_of_anything() -> None:
    larger = Larger()
    shapes = [
        Request(gpus=1, cpu_milli=4000),  # 0
        Request(gpus=1, cpu_milli=8000),  # 1: larger than 0
        Request(gpus=1, cpu_milli=2000, memory_bytes=2**30),  # 2: neither larger nor smaller than 0
        Request(gpu_milli=500, cpu_milli=4000),  # 3: another family (a fraction)
        Request(
            gpus=2, cpu_milli=8000
        ),  # 4: two GPUs: never passed over, a failing one may get a reservation
        Request(gpus=1, cpu_milli=8000, gpu_models=frozenset({"T4"})),  # 5: another family (models)
        Request(gpu_milli=700, cpu_milli=4000),  # 6: larger than 3
        Request(gpus=1, cpu_milli=9000, memory_bytes=2**30),  # 7: larger than 0, 1 and 2
    ]
    for i, r in enumerate(shapes):
        larger.add(i, (r,))
    larger.add(8, (shapes[0], shapes[0]))  # two pods: never passed over
    got = {i: sorted(larger.of(i).tolist()) if larger.of(i) is not None else None for i in range(9)}
    assert got == {0: [1, 7], 1: [7], 2: [7], 3: [6], 4: None, 5: None, 6: None, 7: None, 8: None}


def test_other_changes_to_the_list_are_refused() -> None:
    wl = WaitList()
    wl.add(Job((0, 0.0, 1), 0, 1.0))  # type: ignore[arg-type]
    for change in (
        lambda: wl.extend([]),
        lambda: wl.remove(wl[0]),
        lambda: wl.sort(),
        lambda: wl.clear(),
        lambda: wl.__setitem__(0, wl[0]),
    ):
        with pytest.raises(TypeError, match="WaitList"):
            change()
    with pytest.raises(TypeError, match="one job at a time"):
        del wl[0:1]
    assert len(wl) == 1
