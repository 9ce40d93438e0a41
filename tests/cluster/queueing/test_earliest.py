"""The fast search for a reservation's start makes the same trials as the plain one: same start, same plan."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing import earliest
from gpunode.cluster.queueing.backfill import reserve
from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.model import Job, RunningJob
from gpunode.placement.frag import TargetPod, TargetWorkload
from gpunode.placement.model import GpuState, NodeState, Request

DEFAULT = 30.0
WORKLOAD = TargetWorkload(
    (
        TargetPod(cpu_milli=2000, gpu_milli=1000, gpus=1, gpu_models=None, weight=3),
        TargetPod(cpu_milli=0, gpu_milli=500, gpus=1, gpu_models=None, weight=1),
        TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=4, gpu_models=None, weight=1),
    )
)


def node(name: str, gpus: int, cpu: int, model: str) -> NodeState:
    """An empty node of fractional GPUs with `cpu` cores."""
    return NodeState(
        name=name,
        gpus=tuple(
            GpuState(
                uuid=f"{name}/gpu{j}",
                index=j,
                model=model,
                milli_free=1000,
                memory_total_bytes=16 << 30,
                memory_free_bytes=16 << 30,
                numa_node=None,
            )
            for j in range(gpus)
        ),
        cpu_milli_free=cpu * 1000,
        memory_free_bytes=64 << 30,
    )


pod = st.one_of(
    st.builds(Request, gpus=st.integers(1, 4), cpu_milli=st.sampled_from([0, 1000, 4000, 12000])),
    st.builds(Request, gpu_milli=st.sampled_from([100, 300, 500, 700]), cpu_milli=st.sampled_from([0, 2000])),
    st.builds(Request, cpu_milli=st.sampled_from([1000, 8000]), memory_bytes=st.sampled_from([0, 32 << 30])),
)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(
        st.tuples(
            st.sampled_from([1, 2, 4, 8]), st.sampled_from([8, 16, 64]), st.sampled_from(["T4", "V100"])
        ),
        min_size=1,
        max_size=4,
    ),
    running=st.lists(
        st.tuples(
            st.lists(pod, min_size=1, max_size=3), st.sampled_from([5, 10, 20, 40, 80]), st.integers(0, 60)
        ),
        min_size=2,
        max_size=20,
    ),
    head=st.lists(pod, min_size=1, max_size=3),
    excluded=st.sets(st.integers(0, 3), max_size=1),
    policy=st.sampled_from(["gpunode", "bestfit", "random", "fgd"]),
    energy=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 3),
)
def test_the_fast_search_gives_the_plain_searchs_reservation(
    nodes: list[tuple[int, int, str]],
    running: list[tuple[list[Request], int, int]],
    head: list[Request],
    excluded: set[int],
    policy: str,
    energy: float,
    seed: int,
) -> None:
    now = 50.0
    states = [node(f"n{i}", g, cpu, model) for i, (g, cpu, model) in enumerate(nodes)]
    caps = [
        ClusterCapacity(states, policy=policy, seed=seed, workload=WORKLOAD, energy_weight=energy)
        for _ in range(2)
    ]
    jobs: list[RunningJob] = []
    for i, (pods, estimate, age) in enumerate(running):  # the same commits on both (same seed, same draws)
        j = Job(name=f"r{i}", queue="q", pods=tuple(pods), arrival=0.0, runtime_estimate=float(estimate))
        plans = [cap.plan(j) for cap in caps]
        assert plans[0] == plans[1]
        if plans[0] is not None:
            for cap in caps:
                cap.commit(j.name, j, plans[0])
            jobs.append(RunningJob(job=j, start=now - age, plan=plans[0], usage=caps[0].held(j.name)))
    head_job = Job(name="head", queue="q", pods=tuple(head), arrival=0.0)
    exclude = frozenset(f"n{i}" for i in excluded if i < len(nodes))
    ends = sorted((r.expected_end(DEFAULT), r.job.name) for r in jobs)
    fast = reserve(head_job, (), caps[0], now, DEFAULT, exclude, ends=ends)
    plain = reserve(head_job, jobs, caps[1], now, DEFAULT, exclude, fast=False)
    assert fast == plain
    if plain is not None and plain.start > now:  # the search really ran: its result is the earliest start
        gone = [r.job.name for r in jobs if max(now, r.expected_end(DEFAULT)) < plain.start]
        with caps[1].trial():
            caps[1].release_many(gone)
            assert caps[1].plan(head_job, exclude_nodes=exclude) is None or len(head) > 1
    # neither search changed its cluster; both leave the cluster's random generator in the same state
    assert sorted(caps[0].jobs) == sorted(caps[1].jobs) and caps[0].free() == caps[1].free()
    assert caps[0]._rng.bit_generator.state == caps[1]._rng.bit_generator.state
    assert caps[0].plan(head_job) == caps[1].plan(head_job)


whole = st.builds(Request, gpus=st.integers(1, 4), cpu_milli=st.sampled_from([0, 4000]))
step = st.one_of(
    st.tuples(st.just("commit"), st.lists(whole, min_size=1, max_size=2), st.sampled_from([5, 10, 20, 40])),
    st.tuples(st.just("commit"), st.lists(pod, min_size=1, max_size=2), st.sampled_from([5, 10, 20])),
    st.tuples(st.just("release"), st.integers(0, 30), st.just(0)),
    # released and committed anew under its name (estimate 0: overdue at once)
    st.tuples(st.just("again"), st.integers(0, 30), st.sampled_from([0, 40])),
    st.tuples(st.just("wait"), st.sampled_from([3, 8, 25]), st.just(0)),
)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(st.tuples(st.sampled_from([2, 4]), st.sampled_from([16, 64])), min_size=2, max_size=3),
    steps=st.lists(step, min_size=8, max_size=30),
    heads=st.lists(st.lists(whole, min_size=1, max_size=3), min_size=1, max_size=3),
    policy=st.sampled_from(["gpunode", "bestfit"]),
)
def test_the_fast_searchs_kept_sums_and_states_follow_the_cluster_between_searches(
    nodes: list[tuple[int, int]],
    steps: list[tuple[str, object, int]],
    heads: list[list[Request]],
    policy: str,
) -> None:
    """Searches after commits, releases, jobs committed again under their name and time passing (jobs
    becoming overdue) reuse the first cluster's kept per-node sums and shown states; every reservation
    is still the plain search's on the twin cluster."""
    states = [node(f"n{i}", g, cpu, "T4") for i, (g, cpu) in enumerate(nodes)]
    caps = [ClusterCapacity(states, policy=policy, seed=1, workload=WORKLOAD) for _ in range(2)]
    running: dict[str, RunningJob] = {}
    now, serial = 0.0, 0
    for kind, arg, estimate in steps:
        if kind == "wait":
            now += float(arg)  # type: ignore[arg-type]
        elif kind in ("release", "again") and running:
            name = sorted(running)[int(arg) % len(running)]  # type: ignore[call-overload]
            old = running.pop(name)
            for cap in caps:
                cap.release(name)
            if kind == "again":  # the same name, a new commit (and a new record)
                job = Job(
                    name=name, queue="q", pods=old.job.pods, arrival=0.0, runtime_estimate=float(estimate)
                )
                plan = caps[0].plan(job)
                assert plan == caps[1].plan(job)
                if plan is not None:
                    for cap in caps:
                        cap.commit(name, job, plan)
                    running[name] = RunningJob(job=job, start=now, plan=plan, usage=caps[0].held(name))
        elif kind == "commit":
            serial += 1
            job = Job(
                name=f"r{serial}", queue="q", pods=tuple(arg), arrival=0.0, runtime_estimate=float(estimate)
            )  # type: ignore[arg-type]
            plan = caps[0].plan(job)
            assert plan == caps[1].plan(job)
            if plan is not None:
                for cap in caps:
                    cap.commit(job.name, job, plan)
                running[job.name] = RunningJob(job=job, start=now, plan=plan, usage=caps[0].held(job.name))
        ends = sorted((r.expected_end(DEFAULT), r.job.name) for r in running.values())
        for i, head in enumerate(heads):
            head_job = Job(name=f"head{i}", queue="q", pods=tuple(head), arrival=0.0)
            fast = reserve(head_job, (), caps[0], now, DEFAULT, ends=ends)
            plain = reserve(head_job, list(running.values()), caps[1], now, DEFAULT, fast=False)
            assert fast == plain
    assert caps[0].free() == caps[1].free()
    assert caps[0]._rng.bit_generator.state == caps[1]._rng.bit_generator.state


def test_a_node_shown_without_one_job_is_not_taken_for_the_node_without_another_of_its_size() -> None:
    """Two searches release, on the same unchanged node, first one job and then another of the same
    size (a job planned again moves in the order of ends): the second is shown without its own job, so
    the head gets the GPU that job frees, as the plain search says, not the first search's kept state."""
    caps = [ClusterCapacity([node("n0", 2, 16, "T4")], seed=0, workload=WORKLOAD) for _ in range(2)]
    one = Request(gpus=1, cpu_milli=1000)
    running = []
    for name in ("a", "b"):
        j = Job(name=name, queue="q", pods=(one,), arrival=0.0, runtime_estimate=10.0)
        plan = caps[0].plan(j)
        assert plan is not None and plan == caps[1].plan(j)
        for cap in caps:
            cap.commit(name, j, plan)
        running.append(RunningJob(job=j, start=0.0, plan=plan, usage=caps[0].held(name)))
    gpu_of = {r.job.name: r.plan.pods[0].gpus for r in running}
    assert gpu_of["a"] != gpu_of["b"]
    head = Job(name="head", queue="q", pods=(one,), arrival=0.0)
    for first, then in (("a", "b"), ("b", "a")):
        ends = [(10.0, first), (20.0, then)]
        fast = reserve(head, (), caps[0], 5.0, DEFAULT, ends=ends)
        assert fast is not None and fast.start == 10.0 and fast.plan.pods[0].gpus == gpu_of[first]
        plain_running = [
            RunningJob(
                job=r.job,
                start=0.0,
                plan=r.plan,
                usage=r.usage,
                estimate=10.0 if r.job.name == first else 20.0,
            )
            for r in running
        ]
        assert fast == reserve(head, plain_running, caps[1], 5.0, DEFAULT, fast=False)


def test_the_fast_search_keeping_every_groups_sums_still_gives_the_plain_searchs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups of equal end of LARGE_GROUP jobs or more have their sums kept on the capacity between
    searches (NodeView.released_sums by end): with every group kept so, both properties above hold."""
    monkeypatch.setattr(earliest, "LARGE_GROUP", 1)
    test_the_fast_search_gives_the_plain_searchs_reservation()
    test_the_fast_searchs_kept_sums_and_states_follow_the_cluster_between_searches()
