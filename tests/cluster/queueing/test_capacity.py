"""ClusterCapacity: whole-job trials, commits, exact releases, forks, trials, masks and the energy term."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.model import GPU, GPU_MEMORY, Job, Plan, PodPlacement, model_key
from gpunode.cluster.queueing.nodeview import released_columns
from gpunode.contract.names import GIB
from gpunode.errors import InvalidRequest, InvalidState
from gpunode.placement.fit import apply_request, fits
from gpunode.placement.frag import TargetPod, TargetWorkload
from gpunode.placement.model import GpuState, NodeState, Request

WORKLOAD = TargetWorkload(
    (
        TargetPod(cpu_milli=1000, gpu_milli=1000, gpus=1, gpu_models=None, weight=5),
        TargetPod(cpu_milli=1000, gpu_milli=500, gpus=1, gpu_models=None, weight=3),
        TargetPod(cpu_milli=2000, gpu_milli=1000, gpus=4, gpu_models=None, weight=1),
    )
)


def node(name: str, gpus: int = 8, model: str = "V100M32", mem_gib: int = 32) -> NodeState:
    """An empty node of fractional GPUs with known memory."""
    return NodeState(
        name=name,
        gpus=tuple(
            GpuState(
                uuid=f"{name}/gpu{j}",
                index=j,
                model=model,
                milli_free=1000,
                memory_total_bytes=mem_gib * GIB,
                memory_free_bytes=mem_gib * GIB,
                numa_node=None,
            )
            for j in range(gpus)
        ),
        cpu_milli_free=64000,
        memory_free_bytes=512 * GIB,
    )


def job(name: str, *pods: Request) -> Job:
    """A job of these pods in queue q."""
    return Job(name=name, queue="q", pods=pods, arrival=0.0)


def cap_of(nodes: list[NodeState], **kw: object) -> ClusterCapacity:
    """A capacity with the test workload."""
    return ClusterCapacity(nodes, workload=WORKLOAD, **kw)  # type: ignore[arg-type]


def states(cap: ClusterCapacity) -> list[NodeState]:
    """The node states the capacity holds now."""
    return [cap._arrays.node_state(i) for i in range(len(cap.node_names))]


WHOLE1 = Request(gpus=1, cpu_milli=1000)
WHOLE4 = Request(gpus=4, cpu_milli=2000)
HALF = Request(gpu_milli=500, cpu_milli=1000)


def test_plan_places_every_pod_and_holds_nothing() -> None:
    cap = cap_of([node("a"), node("b")])
    before = states(cap)
    plan = cap.plan(job("g", WHOLE4, WHOLE4, WHOLE4, WHOLE4))
    assert plan is not None and len(plan.pods) == 4
    used = [uuid for p in plan.pods for uuid in p.gpus]
    assert len(used) == len(set(used)) == 16  # every GPU of both nodes, none twice
    assert states(cap) == before and cap.free() == cap.capacity()


def test_a_gang_that_cannot_fit_gets_no_plan_and_nothing_is_held() -> None:
    cap = cap_of([node("a"), node("b")])
    before = states(cap)
    assert cap.plan(job("g", *([WHOLE4] * 5))) is None
    assert states(cap) == before
    assert not cap.fits_empty(job("g", *([WHOLE4] * 5)))
    assert cap.fits_empty(job("g", *([WHOLE4] * 4)))


def test_commit_takes_what_the_plan_says_and_release_undoes_it_exactly() -> None:
    cap = cap_of([node("a"), node("b", model="T4", mem_gib=16)])
    empty = states(cap)
    j = job("j", WHOLE1, HALF)
    plan = cap.plan(j)
    assert plan is not None
    cap.commit("j", j, plan)
    held = cap.held("j")
    assert held[GPU] == 1500
    assert cap.free()[GPU] == cap.capacity()[GPU] - 1500
    assert cap.free()[GPU_MEMORY] < cap.capacity()[GPU_MEMORY]
    assert sum(v for k, v in held.items() if k.startswith("gpu/")) == 1500
    epoch = cap.epoch
    cap.release("j")
    assert cap.epoch != epoch
    assert states(cap) == empty and cap.free() == cap.capacity()


def test_release_rebuilds_a_shared_gpu_from_the_remaining_jobs() -> None:
    cap = cap_of([node("a", gpus=1)])
    for name in ("x", "y"):
        j = job(name, Request(gpu_milli=300, gpu_memory_bytes=4 * GIB, cpu_milli=10))
        plan = cap.plan(j)
        assert plan is not None
        cap.commit(name, j, plan)
    cap.release("x")
    # the node is as if only y had been committed
    only_y = apply_request(
        node("a", gpus=1), Request(gpu_milli=300, gpu_memory_bytes=4 * GIB, cpu_milli=10), ("a/gpu0",)
    )
    assert states(cap) == [only_y]


def test_commit_of_a_plan_that_no_longer_fits_holds_nothing() -> None:
    cap = cap_of([node("a", gpus=2)])
    first = job("first", WHOLE1, WHOLE1)
    plan = cap.plan(first)
    assert plan is not None
    cap.commit("first", first, plan)
    after_first = states(cap)
    stale = Plan(pods=(PodPlacement("a", ("a/gpu0",)),))
    with pytest.raises(InvalidState):
        cap.commit("second", job("second", WHOLE1), stale)
    with pytest.raises(InvalidState, match="already committed"):
        cap.commit("first", first, plan)
    with pytest.raises(InvalidState, match="unknown node"):
        cap.commit("third", job("third", WHOLE1), Plan(pods=(PodPlacement("zz", ("zz/gpu0",)),)))
    with pytest.raises(InvalidState, match="not committed"):
        cap.release("second")
    assert states(cap) == after_first and cap.jobs == ("first",)


def test_a_gang_whose_second_member_fails_on_commit_releases_the_first() -> None:
    cap = cap_of([node("a", gpus=2)])
    before = states(cap)
    bad = Plan(pods=(PodPlacement("a", ("a/gpu0",)), PodPlacement("a", ("a/gpu0",))))
    with pytest.raises(InvalidState):
        cap.commit("g", job("g", WHOLE1, WHOLE1), bad)
    assert states(cap) == before and "g" not in cap


def test_exclude_nodes_is_respected() -> None:
    cap = cap_of([node("a"), node("b"), node("c")])
    for _ in range(20):
        plan = cap.plan(job("j", WHOLE4), exclude_nodes=frozenset({"a", "b"}))
        assert plan is not None and plan.nodes == {"c"}
    assert cap.plan(job("j", WHOLE4, WHOLE4, WHOLE4), exclude_nodes=frozenset({"a", "b"})) is None
    assert cap.plan(job("j", WHOLE4, WHOLE4, WHOLE4), exclude_nodes=frozenset({"a", "b", "nope"})) is None
    assert cap.plan(job("j", WHOLE4, WHOLE4, WHOLE4)) is not None


def test_fork_is_independent_of_the_original() -> None:
    cap = cap_of([node("a"), node("b")])
    j = job("j", WHOLE4)
    plan = cap.plan(j)
    assert plan is not None
    cap.commit("j", j, plan)
    snapshot = states(cap)
    fork = cap.fork()
    fork.release("j")
    assert fork.free() == fork.capacity()
    assert states(cap) == snapshot and "j" in cap and "j" not in fork
    k = job("k", WHOLE4, WHOLE4, WHOLE4, WHOLE4)
    assert cap.plan(k) is None and fork.plan(k) is not None


def test_trial_undoes_commits_and_releases() -> None:
    cap = cap_of([node("a"), node("b")])
    j = job("j", WHOLE4)
    plan = cap.plan(j)
    assert plan is not None
    cap.commit("j", j, plan)
    snapshot, epoch = states(cap), cap.epoch
    with cap.trial():
        cap.release("j")
        big = job("big", *([WHOLE4] * 4))
        big_plan = cap.plan(big)
        assert big_plan is not None
        cap.commit("big", big, big_plan)
        with pytest.raises(InvalidState, match="nest"), cap.trial():
            pass
    assert states(cap) == snapshot and cap.jobs == ("j",) and cap.epoch == epoch


def test_a_trial_puts_back_every_record_it_touched_and_only_those() -> None:
    """Random commits and releases inside trials (jobs sharing GPUs, released and committed again under
    their name): after each trial the records are those before it, and a twin that never ran a trial
    gives the same states, plans and releases from then on."""
    rnd = random.Random(3)
    nodes = [node(f"n{i}", gpus=4) for i in range(5)]
    cap, twin = cap_of(nodes, seed=1), cap_of(nodes, seed=1)
    shapes = [WHOLE1, HALF, Request(gpu_milli=300, cpu_milli=500), Request(gpus=2, cpu_milli=1000)]
    for step in range(40):
        j = job(f"j{step}", rnd.choice(shapes))
        plan = cap.plan(j)
        if plan is not None:
            cap.commit(j.name, j, plan)
            twin.commit(j.name, j, plan)
        if step % 4 == 3 and cap.jobs:
            alloc, held = dict(cap._alloc), dict(cap._jobs)
            with cap.trial():
                for _ in range(rnd.randint(1, 6)):
                    if cap.jobs and rnd.random() < 0.6:
                        name = rnd.choice(cap.jobs)
                        record = cap._jobs[name]
                        cap.release(name)
                        if rnd.random() < 0.5:  # committed again under its name, as the victim search does
                            cap.commit(name, record.job, record.plan)
                    else:
                        extra = job(f"t{step}", rnd.choice(shapes))
                        extra_plan = cap.plan(extra)
                        if extra_plan is not None and extra.name not in cap:
                            cap.commit(extra.name, extra, extra_plan)
            assert cap._alloc == alloc and cap._jobs == held
            assert states(cap) == states(twin)
        if cap.jobs and rnd.random() < 0.3:
            name = rnd.choice(sorted(cap.jobs))
            cap.release(name)
            twin.release(name)
            assert states(cap) == states(twin)
    assert sorted(cap.jobs) == sorted(twin.jobs) and cap.free() == twin.free()


def test_released_sums_follow_releases_recommits_trials_and_forks() -> None:
    """released_sums(names) equals the sums of what those jobs hold, per node and per GPU slot, asked in
    turn by a capacity and its forks, after releases, commits again under the same name (on another node)
    and trials."""
    rnd = random.Random(5)
    nodes = [node(f"n{i}", gpus=4) for i in range(6)]
    cap = cap_of(nodes, seed=2)
    shapes = [WHOLE1, HALF, Request(gpus=2, cpu_milli=1000), Request(gpu_milli=300, cpu_milli=500)]

    shapes.append(Request(gpu_milli=250, gpu_memory_bytes=2 * GIB))
    row_of = {x.name: i for i, x in enumerate(nodes)}
    slot_of = {g.uuid: s for x in nodes for s, g in enumerate(x.gpus)}

    def expected(c: ClusterCapacity, names: list[str]) -> tuple[list[list[int]], list[list[list[int]]], int]:
        """The sums worked out from each job's requests and plan (the marks from its footprint)."""
        rows = np.zeros((len(nodes), 6), dtype=np.int64)
        gpus = np.zeros((len(nodes), 8, 3), dtype=np.int64)
        for n in names:
            mark = c.footprint(n)[0][4]
            for q, pod in zip(c.job_of(n).pods, c.plan_of(n).pods, strict=True):
                row = row_of[pod.node]
                milli = q.gpu_milli if q.kind == "fraction" else 1000 * len(pod.gpus)
                rows[row] += (milli, q.cpu_milli, q.memory_bytes, 1, mark, 0)
                for uuid in pod.gpus:
                    if q.kind == "whole":
                        gpus[row, slot_of[uuid], 0] += 1
                    else:
                        gpus[row, slot_of[uuid], 1:] += (q.gpu_milli, q.gpu_memory_bytes)
        return rows.tolist(), gpus.tolist(), sum(c.held_gpu(n) for n in names)

    def check(c: ClusterCapacity) -> None:
        names = [n for n in c.jobs if int(n[1:]) % 3]  # the same names while they stay committed
        rows, gpus, gpu = c.released_sums(names)
        assert (rows.tolist(), gpus.tolist(), gpu) == expected(c, names)

    def release_for_elsewhere(c: ClusterCapacity, name: str) -> tuple[Job, Plan | None]:
        """Release the job (the sums checked then) and plan it again off the nodes it held."""
        j, away = c.job_of(name), frozenset(c.plan_of(name).nodes)
        c.release(name)
        check(c)
        return j, c.plan(j, exclude_nodes=away)

    caps = [cap]
    for step in range(120):
        c = rnd.choice(caps)
        op = rnd.random()
        if op < 0.1 and len(caps) < 4:
            caps.append(c.fork())
        elif op < 0.4 and c.jobs:
            name = rnd.choice(sorted(c.jobs))
            j, plan = release_for_elsewhere(c, name)
            if plan is not None and rnd.random() < 0.6:  # committed again under its name, elsewhere
                c.commit(name, j, plan)
        elif op < 0.5 and c.jobs:
            with c.trial():
                for name in rnd.sample(sorted(c.jobs), k=min(3, len(c.jobs))):
                    j, plan = release_for_elsewhere(c, name)
                    if plan is not None:
                        c.commit(name, j, plan)
        else:
            j = job(f"j{step}", rnd.choice(shapes))
            plan = c.plan(j)
            if plan is not None:
                c.commit(j.name, j, plan)
        check(rnd.choice(caps))
        check(c)


def test_random_operations_on_forks_keep_plans_right(seed: int = 7) -> None:
    """Forks share score caches: every plan must still equal what fit says on the current states."""
    rnd = random.Random(seed)
    nodes = [
        node(f"n{i}", gpus=rnd.choice([2, 4, 8]), model=rnd.choice(["V100M32", "T4"])) for i in range(12)
    ]
    caps = [cap_of(nodes, seed=seed)]
    shapes = [WHOLE1, WHOLE4, HALF, Request(gpus=2, gpu_models=frozenset({"T4"})), Request(gpu_milli=200)]
    for step in range(400):
        c = rnd.choice(caps)
        op = rnd.random()
        if op < 0.1 and len(caps) < 5:
            caps.append(c.fork())
        elif op < 0.35 and c.jobs:
            c.release(rnd.choice(c.jobs))
        else:
            request = rnd.choice(shapes)
            plan = c.plan(job(f"s{step}", request))
            fitting = [s for s in states(c) if fits(s, request)]
            assert (plan is None) == (not fitting)
            if plan is not None:
                (pod,) = plan.pods
                assert any(s.name == pod.node for s in fitting)
                c.commit(f"s{step}", job(f"s{step}", request), plan)
    for c in caps:  # releasing everything gives the empty cluster back
        for name in c.jobs:
            c.release(name)
        assert states(c) == nodes


@pytest.mark.parametrize("policy", ["gpunode", "bestfit", "spread"])
def test_a_counted_plan_counts_the_largest_prefix_of_like_members_that_places(policy: str) -> None:
    """plan_counted's count for a gang of like members equals the largest k whose first k members
    plan together (each prefix tried on its own), on clusters filled at random."""
    rnd = random.Random(11)
    shapes = [WHOLE1, WHOLE4, HALF, Request(gpus=2, cpu_milli=24000), Request(gpu_milli=300, cpu_milli=1000)]
    checked = {"none": 0, "some": 0, "all": 0}
    for trial in range(60):
        nodes = [node(f"n{i}", gpus=rnd.choice([2, 4, 8])) for i in range(rnd.randint(2, 6))]
        cap = cap_of(nodes, seed=trial, policy=policy)
        for i in range(rnd.randint(0, 20)):  # fill at random
            j = job(f"f{i}", rnd.choice(shapes))
            plan = cap.plan(j)
            if plan is not None:
                cap.commit(j.name, j, plan)
        member = rnd.choice(shapes)
        gang = job("g", *([member] * rnd.randint(1, 12)))
        exclude = frozenset(n.name for n in nodes if rnd.random() < 0.2)
        with cap.draws_kept():
            plan, placed = cap.plan_counted(gang, exclude_nodes=exclude)
        prefixes = [
            k for k in range(len(gang.pods) + 1) if cap.plan(job("p", *gang.pods[:k]), exclude_nodes=exclude)
        ]
        assert placed == max(prefixes) and prefixes == list(range(placed + 1))
        assert (plan is not None) == (placed == len(gang.pods))
        checked["none" if placed == 0 else "all" if plan is not None else "some"] += 1
    assert min(checked.values()) >= 5, checked  # every outcome was met


def test_same_seed_same_plans() -> None:
    def run(seed: int) -> list[Plan | None]:
        cap = cap_of([node(f"n{i}") for i in range(6)], seed=seed, policy="spread")
        out = []
        for i in range(30):
            j = job(f"j{i}", HALF if i % 3 else WHOLE1)
            plan = cap.plan(j)
            out.append(plan)
            if plan is not None:
                cap.commit(j.name, j, plan)
        return out

    assert run(3) == run(3)


def test_plans_that_only_explain_do_not_change_later_choices() -> None:
    """A plan under draws_kept (a gang's waiting reason) leaves the tie-break draws as they were."""

    def run(explain: str) -> list[Plan | None]:
        """Thirty placements, each after an explaining plan made as `explain` says ("", "kept", "drawn")."""
        cap = cap_of([node(f"n{i}") for i in range(6)], seed=5, policy="spread")
        out = []
        for i in range(30):
            why = job("why", WHOLE1, WHOLE1, WHOLE1)
            if explain == "kept":
                with cap.draws_kept():
                    cap.plan(why)
            elif explain == "drawn":
                cap.plan(why)
            j = job(f"j{i}", HALF if i % 3 else WHOLE1)
            plan = cap.plan(j)
            out.append(plan)
            if plan is not None:
                cap.commit(j.name, j, plan)
        return out

    plain = run("")
    assert run("kept") == plain
    assert run("drawn") != plain  # without draws_kept the explanations move later choices (real tie-breaks)


def test_energy_weight_prefers_gpus_on_busy_nodes() -> None:
    nodes = [node("a"), node("b"), node("c")]
    for weight, want_same in ((1.0, True), (0.0, False)):
        cap = cap_of(nodes, policy="spread", energy_weight=weight)
        first = job("first", WHOLE1)
        plan = cap.plan(first)
        assert plan is not None
        cap.commit("first", first, plan)
        for _ in range(10):
            again = cap.plan(job("again", WHOLE1))
            assert again is not None
            assert (again.nodes == plan.nodes) is want_same
    assert cap.nodes_busy() == 1
    activity = cap.gpu_activity()["V100M32"]
    assert (activity.busy, activity.idle_powered, activity.dark) == (1, 7, 16)


def test_energy_term_prefers_a_busy_gpu_for_a_fraction() -> None:
    cap = cap_of([node("a", gpus=1), node("b", gpus=1)], policy="spread", energy_weight=0.6)
    first = job("first", HALF)
    plan = cap.plan(first)
    assert plan is not None
    cap.commit("first", first, plan)
    second = cap.plan(job("second", Request(gpu_milli=300)))
    assert second is not None and second.nodes == plan.nodes


def test_capacity_counts_models_and_memory() -> None:
    cap = cap_of([node("a", gpus=2), node("b", gpus=4, model="T4", mem_gib=16)])
    assert cap.capacity() == {
        GPU: 6000,
        GPU_MEMORY: (2 * 32 + 4 * 16) * GIB,
        model_key("V100M32"): 2000,
        model_key("T4"): 4000,
    }


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"policy": "nope"}, "unknown placement policy"), ({"energy_weight": 1.5}, "energy weight")],
)
def test_bad_arguments_are_one_line_errors(kw: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        cap_of([node("a")], **kw)
    assert "\n" not in str(info.value) and info.value.hint


def test_plans_are_numpy_free_plain_data() -> None:
    cap = cap_of([node("a")])
    plan = cap.plan(job("j", WHOLE1))
    assert plan is not None
    assert all(isinstance(g, str) for p in plan.pods for g in p.gpus)
    assert not isinstance(plan.pods[0].node, np.str_)


def test_rebuild_equals_applying_one_by_one() -> None:
    """release() rebuilds a node in one pass; it must equal apply_request applied allocation by allocation."""
    from gpunode.cluster.queueing.nodetable import Allocation, rebuild

    rnd = random.Random(3)
    for _ in range(200):
        state = base = node("a", gpus=4)
        allocs = []
        for k in range(rnd.randint(0, 6)):
            request = rnd.choice(
                [WHOLE1, HALF, Request(gpu_milli=100, gpu_memory_bytes=2 * GIB, cpu_milli=5, memory_bytes=7)]
            )
            free = [g for g in state.gpus if fits(NodeState("x", (g,), 10**9, 10**12), request)]
            if not free:
                continue
            uuids = (rnd.choice(free).uuid,)
            state = apply_request(state, request, uuids)
            allocs.append(Allocation(job=f"j{k}", request=request, gpus=uuids))
        assert rebuild(base, allocs) == state


def test_nodes_shown_without_jobs_are_the_nodes_those_jobs_released_leave() -> None:
    """show_without builds rows as arrays (what the jobs free added back per GPU, a whole GPU back to its
    state as given) and their NodeState only when asked: every row equals the row of a twin where the
    jobs are really released (arrays, aggregates and node state), on fractional GPUs with and without
    GPU memory asked, whole-mode GPUs, a sick GPU and GPUs partly used from the start, the first time
    (built) and again (put back from the states kept), and a plan on them is the twin's."""
    whole_mode = node("w", gpus=4)
    whole_mode = replace(
        whole_mode,
        gpus=(
            *(replace(g, sharing="whole") for g in whole_mode.gpus[:3]),
            # some of its memory used from the start: not fully free, so not handed out whole
            replace(whole_mode.gpus[3], sharing="whole", memory_free_bytes=30 * GIB),
        ),
    )
    used = node("u", gpus=4)
    used = replace(
        used,
        gpus=(
            replace(used.gpus[0], milli_free=600, memory_free_bytes=10 * GIB),  # partly used from the start
            replace(used.gpus[1], healthy=False),
            *used.gpus[2:],
        ),
    )
    nodes = [node("n0", gpus=8), node("n1", gpus=2), whole_mode, used]
    cap = cap_of(nodes, seed=3)
    rnd = random.Random(11)
    shapes = [
        WHOLE1,
        HALF,
        Request(gpus=2, cpu_milli=2000),
        Request(gpu_milli=250, gpu_memory_bytes=4 * GIB),
        Request(gpu_milli=100, gpu_memory_bytes=12 * GIB),
        Request(cpu_milli=3000, memory_bytes=GIB),
    ]
    for i in range(60):
        j = job(f"j{i}", *rnd.sample(shapes, k=rnd.choice([1, 1, 2])))
        plan = cap.plan(j)
        if plan is not None:
            cap.commit(j.name, j, plan)
    names = sorted(cap.jobs)
    assert len(names) > 20
    rows = np.arange(len(nodes))
    probe = job("probe", Request(gpu_milli=500, cpu_milli=1000))
    fork = cap.fork(books=False)
    for _ in range(2):  # the second time every state is put back from the kept ones
        for k in (0, 1, 5, len(names) // 2, len(names)):
            gone = set(rnd.sample(names, k=k))
            entries = [t for n in sorted(gone) for t in cap.footprint(n)]
            freed = np.zeros((len(nodes), 6), dtype=np.int64)
            freed_gpu = np.zeros((len(nodes), 8, 3), dtype=np.int64)
            if entries:
                at, per_row, per_gpu = released_columns(np.array(entries, dtype=np.int64))
                np.add.at(freed, at, per_row)
                np.add.at(freed_gpu, at, per_gpu)
            fork.show_without(gone, rows, freed, freed_gpu, cap)
            twin = cap.fork()
            twin.release_many(sorted(gone))
            shown, real = fork._arrays.rows_state(rows), twin._arrays.rows_state(rows)
            for f in shown:
                if f != "version":
                    assert shown[f].tolist() == real[f].tolist(), f
            assert states(fork) == states(twin)
            with fork.draws_kept(), twin.draws_kept():
                assert fork.plan(probe) == twin.plan(probe)
