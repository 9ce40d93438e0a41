"""The numpy form (placement.batch) decides exactly as the per-node functions, on random clusters."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.errors import InvalidRequest, InvalidState
from gpunode.placement import (
    GpuState,
    NodeCapacity,
    NodeState,
    Request,
    TargetPod,
    TargetWorkload,
    apply_request,
    fits,
    place,
    score_node,
)
from gpunode.placement.batch import ClusterArrays

DETERMINISTIC = ("fgd", "gpunode", "bestfit", "packing", "spread", "dotprod")
GIB = 2**30
MODELS = ("G2", "T4", "P100")


def random_cluster(rng: random.Random, n: int = 10, offers: random.Random | None = None) -> list[NodeState]:
    """Nodes the batch form covers: one model each; fractional GPUs with or without a memory size, or whole-mode
    ones; unhealthy, MIG and time-sliced GPUs mixed in. Fractional GPUs serve whole requests on some nodes,
    on others not (as an agent publishes them), and on others GPU by GPU, drawn from `offers` (without it,
    every fractional GPU serves whole requests too)."""
    nodes = []
    for i in range(n):
        count = rng.choice([0, 1, 2, 4, 8, 8])
        model = rng.choice(MODELS)
        mode = rng.choice(["fractional", "fractional", "whole"])
        sized = rng.random() < 0.5
        offered_whole = offers.choice(["all", "none", "some"]) if offers else "all"
        gpus = []
        for j in range(count):
            sharing = mode if rng.random() < 0.85 else rng.choice(["mig", "time-sliced"])
            total = 16 * GIB if sized and sharing == "fractional" else 0
            milli = (
                rng.choice([0, 90, 190, 300, 530, 540, 1000, 1000, 1000]) if sharing == "fractional" else 1000
            )
            free = min(total, rng.choice([0, GIB, 6 * GIB, 16 * GIB, 16 * GIB])) if total else 0
            if sharing == "whole" and rng.random() < 0.3:
                milli = 0  # handed out whole
            gpus.append(
                GpuState(
                    uuid=f"n{i}-g{j}",
                    index=j,
                    model=model,
                    numa_node=None,
                    memory_total_bytes=total,
                    memory_free_bytes=free,
                    milli_free=milli,
                    healthy=rng.random() < 0.9,
                    sharing=sharing,
                    mig_free={"1g.10gb": 2} if sharing == "mig" else {},
                    serves_whole=offered_whole == "all"
                    or (offered_whole == "some" and bool(offers and offers.random() < 0.5)),
                )
            )
        nodes.append(
            NodeState(
                name=f"n{i}",
                gpus=tuple(gpus),
                cpu_milli_free=rng.randrange(0, 96_001, 500),
                memory_free_bytes=rng.randrange(0, 2**36, 2**28),
            )
        )
    return nodes


def random_workload(rng: random.Random, nodes: list[NodeState] | None = None) -> TargetWorkload:
    pods = [
        TargetPod(cpu_milli=rng.choice([2000, 4000, 12000]), gpu_milli=0, gpus=0, gpu_models=None, weight=3)
    ]
    for _ in range(rng.randint(2, 7)):
        whole = rng.random() < 0.5
        models = frozenset(rng.sample(MODELS, rng.randint(1, 2))) if rng.random() < 0.3 else None
        pods.append(
            TargetPod(
                cpu_milli=rng.choice([0, 3000, 8000, 11300]),
                gpu_milli=1000 if whole else rng.choice([160, 320, 460, 470, 810]),
                gpus=rng.choice([1, 2, 8]) if whole else 1,
                gpu_models=models,
                weight=rng.randint(1, 50),
            )
        )
    workload = TargetWorkload(tuple(pods))
    # Node pressure for most of the nodes (one-model nodes only); the others get their model's alone.
    capacities = [
        NodeCapacity(n.name, n.gpus[0].model, len(n.gpus), rng.choice([16_000, 64_000, 96_000, 128_000]))
        for n in nodes or ()
        if n.gpus and len({g.model for g in n.gpus}) == 1 and rng.random() < 0.8
    ]
    return workload.with_supply({"G2": 40, "T4": 12, "P100": 6}, nodes=capacities)


def random_request(rng: random.Random) -> Request:
    models = frozenset({rng.choice(MODELS)}) if rng.random() < 0.25 else None
    cpu, mem = rng.choice([0, 1000, 4000, 12000]), rng.choice([0, 2**30, 2**34])
    kind = rng.random()
    if kind < 0.2:
        return Request(cpu_milli=cpu, memory_bytes=mem)
    if kind < 0.55:
        return Request(gpus=rng.choice([1, 1, 2, 4]), gpu_models=models, cpu_milli=cpu, memory_bytes=mem)
    return Request(
        gpu_milli=rng.choice([50, 160, 300, 460, 810, 999]),
        gpu_models=models,
        cpu_milli=cpu,
        memory_bytes=mem,
    )


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_batch_scores_equal_per_node_scores(seed: int) -> None:
    rng = random.Random(seed)
    nodes = random_cluster(rng, offers=random.Random(seed + 1))
    workload = random_workload(rng, nodes)
    cluster = ClusterArrays(nodes, workload=workload)
    compared = 0
    for step in range(6):
        request = random_request(rng)
        for policy in DETERMINISTIC:
            feasible, score, gpu = cluster.scores(request, policy)
            for i in range(len(nodes)):
                state = cluster.node_state(i)
                assert feasible[i] == fits(state, request), (policy, i)
                choice = score_node(state, request, policy=policy, workload=workload)
                if choice is None:
                    continue
                assert score[i] == choice.score, (policy, step, i, score[i], choice.score)
                compared += 1
                if request.kind == "fraction":
                    assert state.gpus[gpu[i]].uuid == choice.gpu_uuids[0], (policy, step, i)
        # Evolve the cluster with one decision of a random policy, applied on both sides.
        policy = rng.choice(DETERMINISTIC)
        priority = np.arange(len(nodes))
        picked = cluster.choose(request, policy, rng=np.random.default_rng(seed), priority=priority)
        expected = place(
            [cluster.node_state(i) for i in range(len(nodes))], request, policy=policy, workload=workload
        )
        if picked is None:
            assert expected is None
            continue
        assert expected is not None and expected.node == cluster.names[picked.node]
        state = cluster.node_state(picked.node)
        assert tuple(state.gpus[s].uuid for s in picked.gpus) == expected.gpu_uuids
        cluster.apply(request, picked.node, picked.gpus)
        assert cluster.node_state(picked.node) == apply_request(state, request, expected.gpu_uuids)
    assert compared > 0


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_scores_deferred_past_feasibility_checks_equal_fresh_scores(seed: int) -> None:
    """feasible_now leaves scores (and the node aggregates) to be computed when asked for; what is asked
    later equals what a cluster built from the same states gives, however many states came between."""
    rng = random.Random(seed)
    nodes = random_cluster(rng, n=8, offers=random.Random(seed + 1))
    workload = random_workload(rng, nodes)
    cluster = ClusterArrays(nodes, workload=workload)
    requests = [random_request(rng) for _ in range(4)]
    gen = np.random.default_rng(seed)
    for _ in range(30):
        request = rng.choice(requests)
        policy = rng.choice(DETERMINISTIC)
        if rng.random() < 0.6:  # only feasibility: scores and aggregates stay stale
            feasible = cluster.feasible_now(request, policy)
            for i in range(len(nodes)):
                assert feasible[i] == fits(cluster.node_state(i), request)
        else:
            fresh = ClusterArrays([cluster.node_state(i) for i in range(len(nodes))], workload=workload)
            got, want = cluster.scores(request, policy), fresh.scores(request, policy)
            assert (got[0] == want[0]).all()
            ok = want[0]
            assert (got[1][ok] == want[1][ok]).all() and (got[2][ok] == want[2][ok]).all()
        placed = rng.choice(requests)  # the cluster moves on (one placement) between the checks
        picked = cluster.choose(placed, rng.choice(DETERMINISTIC), rng=gen)
        if picked is not None:
            cluster.apply(placed, picked.node, picked.gpus)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_batch_never_over_allocates(seed: int) -> None:
    rng = random.Random(seed)
    nodes = random_cluster(rng, n=6, offers=random.Random(seed + 1))
    cluster = ClusterArrays(nodes, workload=random_workload(rng, nodes))
    gen = np.random.default_rng(seed)
    for _ in range(40):
        request = random_request(rng)
        policy = rng.choice((*DETERMINISTIC, "random"))
        before = cluster.node_state(0) if len(nodes) else None
        picked = cluster.choose(request, policy, rng=gen)
        if picked is None:
            continue
        assert fits(cluster.node_state(picked.node), request)
        cluster.apply(request, picked.node, picked.gpus)
        assert (cluster.share >= 0).all() and (cluster.share <= 1000).all() and (cluster.milli >= 0).all()
        assert (cluster.gmem_free >= 0).all() and (cluster.gmem_free <= cluster.gmem_total).all()
        assert (cluster.cpu >= 0).all() and (cluster.mem >= 0).all()
        assert before is not None


def test_random_policy_picks_every_fitting_node_and_nothing_else() -> None:
    nodes = random_cluster(random.Random(7), n=12)
    cluster = ClusterArrays(nodes)
    request = Request(gpu_milli=300)
    feasible = {cluster.names[i] for i in np.flatnonzero(cluster.feasible_in(request, np.arange(12)))}
    gen = np.random.default_rng(1)
    seen = set()
    for _ in range(300):
        picked = cluster.choose(request, "random", rng=gen)
        assert picked is not None
        seen.add(cluster.names[picked.node])
    assert seen == feasible


def gpu(j: int, **kw: object) -> GpuState:
    base: dict[str, object] = dict(
        uuid=f"g{j}",
        index=j,
        model="A",
        milli_free=1000,
        memory_total_bytes=0,
        memory_free_bytes=0,
        numa_node=None,
    )
    base.update(kw)
    return GpuState(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "gpus",
    [
        pytest.param((gpu(0), gpu(1, sharing="whole")), id="mixed-modes"),
        pytest.param((gpu(0), gpu(1, model="B")), id="mixed-models"),
        pytest.param(tuple(gpu(j) for j in range(9)), id="nine-gpus"),
    ],
)
def test_batch_refuses_nodes_it_does_not_cover(gpus: tuple[GpuState, ...]) -> None:
    node = NodeState(name="n", gpus=gpus, cpu_milli_free=1, memory_free_bytes=1)
    with pytest.raises(InvalidState):
        ClusterArrays([node])


def test_batch_refuses_requests_it_does_not_cover() -> None:
    cluster = ClusterArrays(random_cluster(random.Random(1), n=2))
    with pytest.raises(InvalidRequest):
        cluster.scores(Request(mig_profile="1g.10gb"), "bestfit")
    with pytest.raises(InvalidRequest):
        cluster.scores(Request(gpus=1), "fgd")  # no workload given
    with pytest.raises(InvalidRequest):
        cluster.scores(Request(gpus=1), "tetris")


def test_whole_requests_never_take_a_gpu_shared_by_memory_only() -> None:
    """A node's fully free fractional GPUs that it does not offer whole (serves_whole False, as its agent
    publishes them) take no whole-GPU request, in the batch form as in the per-node functions; the
    whole GPUs of another node do."""
    shared = NodeState(
        name="shared",
        gpus=tuple(gpu(j, serves_whole=False) for j in range(4)),
        cpu_milli_free=64_000,
        memory_free_bytes=2**36,
    )
    offered = NodeState(
        name="offered",
        gpus=(gpu(0), gpu(1, serves_whole=False)),  # GPU 0 also offered whole, GPU 1 not
        cpu_milli_free=64_000,
        memory_free_bytes=2**36,
    )
    workload = TargetWorkload(
        (
            TargetPod(cpu_milli=0, gpu_milli=1000, gpus=1, gpu_models=None, weight=1),
            TargetPod(cpu_milli=0, gpu_milli=300, gpus=1, gpu_models=None, weight=1),
        )
    )
    cluster = ClusterArrays([shared, offered], workload=workload)
    for request in (Request(gpus=1), Request(gpus=2)):
        feasible = cluster.feasible_in(request, np.arange(2))
        assert list(feasible) == [fits(shared, request), fits(offered, request)] == [False, request.gpus == 1]
        for policy in DETERMINISTIC:
            picked = cluster.choose(request, policy, rng=np.random.default_rng(0))
            expected = place([shared, offered], request, policy=policy, workload=workload)
            if request.gpus == 2:
                assert picked is None and expected is None
                continue
            assert picked is not None and expected is not None
            assert (cluster.names[picked.node], picked.gpus) == ("offered", (0,))
            assert expected.node == "offered" and expected.gpu_uuids == ("g0",)
    # A fraction still lands on the GPUs shared by memory.
    assert cluster.choose(Request(gpu_milli=300), "bestfit", rng=np.random.default_rng(0)) is not None
