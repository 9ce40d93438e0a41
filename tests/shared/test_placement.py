"""Placement: fit, fragmentation, every policy's score and GPU choice, topology, replicas."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.errors import GpunodeError, InvalidRequest, InvalidState, Unsatisfiable
from gpunode.placement import (
    POLICIES,
    GpuState,
    NodeCapacity,
    NodeState,
    Request,
    TargetPod,
    TargetWorkload,
    apply_request,
    fits,
    fragmentation,
    place,
    preferred_fraction_gpu,
    preferred_replicas,
    preferred_whole_gpus,
    score_node,
    unfit_reason,
)
from gpunode.placement.ours import fill_fragmentation

GIB = 2**30


def gpu(i: int, milli: int = 1000, **kw: object) -> GpuState:
    base: dict[str, object] = dict(
        uuid=f"GPU-{i}",
        index=i,
        model="A100",
        milli_free=milli,
        memory_total_bytes=0,
        memory_free_bytes=0,
        numa_node=0,
    )
    base.update(kw)
    return GpuState(**base)  # type: ignore[arg-type]


def node(*shares: int, cpu: int = 64_000, mem: int = 256 * GIB, name: str = "n1", **kw: object) -> NodeState:
    return NodeState(
        name=name,
        gpus=tuple(gpu(i, s, **kw) for i, s in enumerate(shares)),
        cpu_milli_free=cpu,
        memory_free_bytes=mem,
    )


# ----- data validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"gpus": -1}, id="negative-gpus"),
        pytest.param({"gpu_milli": 1000}, id="whole-gpu-as-milli"),
        pytest.param({"gpus": 1, "gpu_milli": 500}, id="whole-and-fraction"),
        pytest.param({"gpus": 1, "mig_profile": "1g.10gb"}, id="whole-and-mig"),
        pytest.param({"gpu_memory_bytes": GIB, "mig_profile": "1g.10gb"}, id="fraction-and-mig"),
        pytest.param({"mig_profile": ""}, id="empty-mig-profile"),
        pytest.param({"gpus": 1, "gpu_models": frozenset()}, id="empty-model-set"),
        pytest.param({"cpu_milli": -5}, id="negative-cpu"),
    ],
)
def test_invalid_requests_are_refused_with_a_hint(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as err:
        Request(**kwargs)  # type: ignore[arg-type]
    assert isinstance(err.value, GpunodeError) and isinstance(err.value, ValueError)
    assert err.value.hint


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        pytest.param({}, "cpu", id="cpu"),
        pytest.param({"gpus": 2}, "whole", id="whole"),
        pytest.param({"gpu_milli": 300}, "fraction", id="milli"),
        pytest.param({"gpu_memory_bytes": GIB}, "fraction", id="memory"),
        pytest.param({"mig_profile": "1g.10gb"}, "mig", id="mig"),
    ],
)
def test_request_kind(kwargs: dict[str, object], kind: str) -> None:
    assert Request(**kwargs).kind == kind  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"milli_free": 1001}, id="milli-over-capacity"),
        pytest.param({"memory_total_bytes": GIB, "memory_free_bytes": 2 * GIB}, id="more-free-than-total"),
        pytest.param({"sharing": "shared"}, id="unknown-sharing"),
        pytest.param({"nvlink_peers": frozenset({"GPU-0"})}, id="own-peer"),
        pytest.param({"mig_free": {"1g.10gb": -1}}, id="negative-mig"),
    ],
)
def test_invalid_gpu_states_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidState):
        gpu(0, **kwargs)


def test_node_rejects_duplicate_uuids_and_orders_gpus_by_index() -> None:
    with pytest.raises(InvalidState):
        NodeState(name="n", gpus=(gpu(0), gpu(0)), cpu_milli_free=0, memory_free_bytes=0)
    n = NodeState(name="n", gpus=(gpu(2), gpu(0), gpu(1)), cpu_milli_free=0, memory_free_bytes=0)
    assert [g.index for g in n.gpus] == [0, 1, 2]


# ----- fit ----------------------------------------------------------------------------------------------


MEM_GPU = {"memory_total_bytes": 16 * GIB, "memory_free_bytes": 16 * GIB}


@pytest.mark.parametrize(
    ("state", "request_", "reason"),
    [
        pytest.param(node(1000, 1000), Request(gpus=2), None, id="two-whole-fit"),
        pytest.param(node(1000, 999), Request(gpus=2), "insufficient whole GPUs", id="partly-used-not-whole"),
        pytest.param(node(400), Request(gpu_milli=400), None, id="exact-fraction"),
        pytest.param(node(399), Request(gpu_milli=400), "no GPU with 400 milli-GPU", id="fraction-too-big"),
        pytest.param(
            node(1000), Request(gpu_memory_bytes=GIB), "bytes of GPU memory", id="memory-needs-size"
        ),
        pytest.param(node(1000, **MEM_GPU), Request(gpu_memory_bytes=4 * GIB), None, id="memory-fits"),
        pytest.param(node(1000, cpu=1000), Request(gpus=1, cpu_milli=2000), "insufficient CPU", id="cpu"),
        pytest.param(
            node(1000, mem=GIB), Request(gpus=1, memory_bytes=2 * GIB), "insufficient memory", id="mem"
        ),
        pytest.param(
            node(1000), Request(gpus=1, gpu_models=frozenset({"H100"})), "no GPU of model", id="model"
        ),
        pytest.param(node(1000), Request(gpus=1, gpu_models=frozenset({"a100"})), None, id="model-case"),
        pytest.param(node(1000, healthy=False), Request(gpus=1), "insufficient whole GPUs", id="unhealthy"),
        pytest.param(
            node(1000, sharing="whole"), Request(gpu_milli=10), "no GPU with", id="whole-mode-no-frac"
        ),
        pytest.param(
            node(1000, sharing="time-sliced"), Request(gpus=1), "insufficient whole", id="time-sliced"
        ),
        pytest.param(
            node(1000, sharing="mig", mig_free={"1g.10gb": 1}),
            Request(mig_profile="1g.10gb"),
            None,
            id="mig-fits",
        ),
        pytest.param(
            node(1000, sharing="mig", mig_free={"1g.10gb": 0}),
            Request(mig_profile="1g.10gb"),
            "no free MIG",
            id="mig-used",
        ),
        pytest.param(node(0, cpu=0), Request(), None, id="cpu-only-zero"),
    ],
)
def test_fit(state: NodeState, request_: Request, reason: str | None) -> None:
    got = unfit_reason(state, request_)
    if reason is None:
        assert got is None and fits(state, request_)
    else:
        assert got is not None and reason in got and not fits(state, request_)


def test_model_matching_by_word() -> None:
    n = NodeState(
        name="n", gpus=(gpu(0, model="NVIDIA A100-SXM4-80GB"),), cpu_milli_free=1, memory_free_bytes=1
    )
    assert fits(n, Request(gpus=1, gpu_models=frozenset({"A100"})))
    assert not fits(n, Request(gpus=1, gpu_models=frozenset({"A10"})))


def test_apply_request_accounts_every_dimension() -> None:
    n = node(1000, 600, cpu=10_000, mem=10 * GIB, **MEM_GPU)
    after = apply_request(
        n, Request(gpu_milli=300, gpu_memory_bytes=4 * GIB, cpu_milli=1500, memory_bytes=GIB), ("GPU-1",)
    )
    assert after.gpu("GPU-1").milli_free == 300
    assert after.gpu("GPU-1").memory_free_bytes == 12 * GIB
    assert after.gpu("GPU-0") == n.gpu("GPU-0")
    assert (after.cpu_milli_free, after.memory_free_bytes) == (8500, 9 * GIB)
    with pytest.raises(InvalidState):
        apply_request(n, Request(gpus=1), ("GPU-1",))  # partly used: not whole
    with pytest.raises(InvalidState):
        apply_request(n, Request(gpus=2), ("GPU-0", "GPU-0"))


# ----- fragmentation, hand-worked -------------------------------------------------------------------------

# Target workload: 3 x (1 whole GPU, 8 cores), 1 x (500 milli, 2 cores), 1 x CPU-only.
WORKLOAD = TargetWorkload(
    (
        TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=1, gpu_models=None, weight=3),
        TargetPod(cpu_milli=2000, gpu_milli=500, gpus=1, gpu_models=None, weight=1),
        TargetPod(cpu_milli=1000, gpu_milli=0, gpus=0, gpu_models=None, weight=1),
    )
)


def test_fgd_fragmentation_hand_worked() -> None:
    # Node: GPUs with 1000, 700 and 300 milli free, 10 cores free. Total free = 2000.
    #  whole pod: fits (one GPU with 1000, 10 >= 8 cores): fragment = GPUs under 1000 = 700 + 300 = 1000
    #  500 pod:   fits: fragment = GPUs under 500 = 300
    #  CPU pod:   asks no GPU: all 2000 free is fragment
    # weighted: 3*1000 + 1*300 + 1*2000 = 5300 (scaled), i.e. 5300/5 = 1060 milli-GPU
    n = node(1000, 700, 300, cpu=10_000)
    assert fragmentation(n, WORKLOAD) == 5300
    # With 7 cores the whole pod cannot run (lack CPU): all 2000 counts for it: 3*2000 + 300 + 2000
    assert fragmentation(node(1000, 700, 300, cpu=7_000), WORKLOAD) == 8300


def test_fgd_score_hand_worked() -> None:
    # Place 300 milli (1 core) on the 700-milli GPU of the node above: 1000, 400, 300 free, 9 cores.
    #  whole: fragment 400 + 300 = 700; 500 pod: fragment 400 + 300 = 700; CPU: 1700
    #  after = 3*700 + 700 + 1700 = 4500; decrease = 5300 - 4500 = 800 scaled = 160 milli-GPU
    #  score = floor(100 * sigmoid(0.16)) = floor(53.99) = 53
    n = node(1000, 700, 300, cpu=10_000)
    r = Request(gpu_milli=300, cpu_milli=1000)
    assert fragmentation(apply_request(n, r, ("GPU-1",)), WORKLOAD) == 4500
    assert WORKLOAD.fgd_score(800) == math.floor(100 / (1 + math.exp(-0.16))) == 53
    # On the 1000 GPU instead: 700, 700, 300 free: whole cannot run -> 1700; 500: 300; CPU: 1700
    #  after = 3*1700 + 300 + 1700 = 7100, decrease -1800 scaled = -360 milli -> floor(100*sigmoid(-0.36)) = 41
    assert WORKLOAD.fgd_score(5300 - 7100) == 41
    # On the 300 GPU (an exact fit): 1000, 700, 0 free: whole 700; 500 pod: 0; CPU 1700 -> 3800, +1500 -> 57
    assert fragmentation(apply_request(n, r, ("GPU-2",)), WORKLOAD) == 3800
    choice = score_node(n, r, policy="fgd", workload=WORKLOAD)
    assert choice is not None and choice.gpu_uuids == ("GPU-2",) and choice.score == 57


@pytest.mark.parametrize(
    ("decrease_milli", "score"),
    [
        pytest.param(0, 50, id="zero"),
        pytest.param(-10_000, 0, id="large-increase"),
        pytest.param(3000, 95, id="three-gpus"),
        pytest.param(40_000, 100, id="saturated"),
    ],
)
def test_fgd_score_matches_sigmoid(decrease_milli: int, score: int) -> None:
    scaled = decrease_milli * WORKLOAD.total_weight
    assert WORKLOAD.fgd_score(scaled) == score == int(100 / (1 + math.exp(-decrease_milli / 1000)))


def test_fill_fragmentation_sees_cpu_that_fgd_does_not() -> None:
    # 4 free GPUs, 20 cores: FGD's one-pod test passes for the whole 8-core pod (fragment 0 for it), but only
    # two such pods fit by CPU, so two GPUs are stranded: fill fragmentation counts 2000 for that shape.
    n = node(1000, 1000, 1000, 1000, cpu=20_000)
    assert fragmentation(n, WORKLOAD) == 3 * 0 + 1 * 0 + 1 * 4000
    #  whole: 2 copies -> 4000 - 2000 = 2000; 500 pod: min(8 by GPU, 10 by CPU) copies = 4000 -> 0; CPU: 4000
    assert fill_fragmentation(n, WORKLOAD) == 3 * 2000 + 0 + 4000


# ----- policies -------------------------------------------------------------------------------------------


def test_bestfit_dotprod_spread_packing_scores_hand_worked() -> None:
    n = node(1000, 1000, 600, 1000, 1000, 1000, 1000, 1000, cpu=64_000)  # 7600 free of 8000
    r = Request(gpu_milli=500, cpu_milli=16_000)
    # bestfit: 1 - (0.5 * 48000/128000 + 0.5 * 7100/8000) = 1 - (0.1875 + 0.44375) = 0.36875 -> 36
    bf = score_node(n, r, policy="bestfit")
    assert bf is not None and bf.score == 36 and bf.gpu_uuids == ("GPU-2",)
    sp = score_node(n, r, policy="spread")
    assert sp is not None and sp.score == 63 and sp.gpu_uuids == ("GPU-0",)
    # dotprod: <(0.5, 0.95), (0.125, 0.0625)> = 0.0625 + 0.059375 = 0.121875; 100 * (1 - 0.0609375) -> 93
    dp = score_node(n, r, policy="dotprod")
    assert dp is not None and dp.score == 93
    # packing: a shared GPU is used (600 free -> 60% -> 100 - 60//10 = 94)
    pk = score_node(n, r, policy="packing")
    assert pk is not None and pk.score == 94 and pk.gpu_uuids == ("GPU-2",)
    # packing on a fresh node: 33 - 8 free GPUs = 25; on a used node a free GPU: 50 - 1 = 49
    fresh = score_node(node(*[1000] * 8), r, policy="packing")
    assert fresh is not None and fresh.score == 25
    used_free = score_node(node(1000, 300), Request(gpu_milli=500), policy="packing")
    assert used_free is not None and used_free.score == 49


def test_every_policy_returns_none_when_nothing_fits() -> None:
    for policy in POLICIES:
        assert score_node(node(100), Request(gpu_milli=500), policy=policy, workload=WORKLOAD) is None


def test_workload_policies_need_a_workload() -> None:
    for policy in ("fgd", "gpunode"):
        with pytest.raises(InvalidRequest):
            score_node(node(1000), Request(gpus=1), policy=policy)


def test_unknown_policy() -> None:
    with pytest.raises(InvalidRequest) as err:
        place([node(1000)], Request(gpus=1), policy="tetris")
    assert "gpunode" in err.value.hint


def test_place_picks_best_node_and_breaks_ties_in_order_or_by_rng() -> None:
    a, b, c = node(1000, name="a"), node(300, name="b"), node(300, name="c")
    r = Request(gpu_milli=200)
    best = place([a, b, c], r, policy="bestfit")
    assert best is not None and best.node == "b"  # tighter, first of the tie in order
    seen = {place([a, b, c], r, policy="bestfit", rng=random.Random(s)).node for s in range(40)}  # type: ignore[union-attr]
    assert seen == {"b", "c"}
    assert place([node(100)], r, policy="bestfit") is None


def test_gpunode_prefers_the_node_that_does_not_strand_gpus_for_lack_of_cpu() -> None:
    # Two 4-GPU nodes with 48 and 28 free cores. A CPU-only pod of 12 cores leaves 36 cores on the first:
    # still 4 whole 8-core pods for its 4 GPUs; on the second it leaves 16 cores: 2 pods, a second GPU
    # stranded. FGD's one-pod test sees nothing (8 cores remain either way); fill fragmentation does.
    fresh = node(1000, 1000, 1000, 1000, cpu=48_000, name="fresh")
    hit = node(1000, 1000, 1000, 1000, cpu=28_000, name="hit")
    r = Request(cpu_milli=12_000)
    got = place([hit, fresh], r, policy="gpunode", workload=WORKLOAD)
    assert got is not None and got.node == "fresh"
    # FGD's one-pod test sees no change on either node (a tie) and keeps the first one given.
    fgd = place([hit, fresh], r, policy="fgd", workload=WORKLOAD)
    assert fgd is not None and fgd.node == "hit"
    assert score_node(hit, r, policy="fgd", workload=WORKLOAD) == score_node(
        fresh, r, policy="fgd", workload=WORKLOAD
    )


# ----- node-side choices ----------------------------------------------------------------------------------


def topo_node() -> NodeState:
    """8 GPUs: NVLink islands {0,1,2,3} and {4,5,6,7}; NUMA 0 for 0-3 and 1 for 4-7; GPU 1 lacks a link to 2."""
    islands = [{0, 1, 2, 3}, {4, 5, 6, 7}]
    gpus = []
    for i in range(8):
        island = islands[0] if i < 4 else islands[1]
        peers = {f"GPU-{j}" for j in island if j != i}
        if i == 1:
            peers.discard("GPU-2")
        if i == 2:
            peers.discard("GPU-1")
        gpus.append(gpu(i, numa_node=0 if i < 4 else 1, nvlink_peers=frozenset(peers)))
    return NodeState(name="dgx", gpus=tuple(gpus), cpu_milli_free=1, memory_free_bytes=1)


ALL8 = [f"GPU-{i}" for i in range(8)]


@pytest.mark.parametrize(
    ("count", "available", "must", "expected"),
    [
        pytest.param(2, ALL8, [], ("GPU-0", "GPU-1"), id="first-linked-pair"),
        pytest.param(4, ALL8, [], ("GPU-4", "GPU-5", "GPU-6", "GPU-7"), id="fully-linked-island"),
        pytest.param(3, ALL8, [], ("GPU-0", "GPU-1", "GPU-3"), id="all-pairs-linked-triple"),
        pytest.param(2, ["GPU-1", "GPU-2", "GPU-5"], [], ("GPU-1", "GPU-2"), id="same-numa-when-no-link"),
        pytest.param(2, ["GPU-0", "GPU-5", "GPU-6"], ["GPU-0"], ("GPU-0", "GPU-5"), id="must-include"),
        pytest.param(8, ALL8, [], tuple(ALL8), id="all"),
    ],
)
def test_preferred_whole_gpus(
    count: int, available: list[str], must: list[str], expected: tuple[str, ...]
) -> None:
    got = preferred_whole_gpus(topo_node(), count=count, available=available, must_include=must)
    assert got == expected
    assert got == preferred_whole_gpus(
        topo_node(), count=count, available=list(reversed(available)), must_include=must
    )


@pytest.mark.parametrize(
    ("count", "available", "must"),
    [
        pytest.param(3, ["GPU-0", "GPU-1"], [], id="too-few"),
        pytest.param(1, ["GPU-0"], ["GPU-1"], id="must-not-available"),
        pytest.param(1, ALL8, ["GPU-0", "GPU-1"], id="must-more-than-count"),
        pytest.param(-1, ALL8, [], id="negative"),
    ],
)
def test_preferred_whole_gpus_errors(count: int, available: list[str], must: list[str]) -> None:
    with pytest.raises(ValueError):
        preferred_whole_gpus(topo_node(), count=count, available=available, must_include=must)


FREE = {"GPU-a": ["a::0", "a::1", "a::2"], "GPU-b": ["b::0"], "GPU-c": ["c::0", "c::1"]}


@pytest.mark.parametrize(
    ("mode", "count", "must", "expected"),
    [
        pytest.param("spread", 3, [], ("a::0", "a::1", "c::0"), id="spread"),
        pytest.param("pack", 3, [], ("b::0", "c::0", "c::1"), id="pack"),
        pytest.param("spread", 2, ["b::0"], ("b::0", "a::0"), id="must-include"),
        pytest.param("pack", 0, [], (), id="none"),
    ],
)
def test_preferred_replicas(mode: str, count: int, must: list[str], expected: tuple[str, ...]) -> None:
    assert preferred_replicas(FREE, count=count, must_include=must, mode=mode) == expected


@pytest.mark.parametrize(
    ("count", "must", "mode"),
    [
        pytest.param(7, [], "spread", id="too-many"),
        pytest.param(1, ["z::9"], "pack", id="unknown-must"),
        pytest.param(1, [], "fill", id="bad-mode"),
    ],
)
def test_preferred_replicas_errors(count: int, must: list[str], mode: str) -> None:
    with pytest.raises(Unsatisfiable):
        preferred_replicas(FREE, count=count, must_include=must, mode=mode)


def test_preferred_fraction_gpu_picks_among_candidates_only() -> None:
    n = node(1000, 350, 600)
    r = Request(gpu_milli=300)
    assert preferred_fraction_gpu(n, r, candidates=["GPU-0", "GPU-1", "GPU-2"], policy="bestfit") == "GPU-1"
    assert preferred_fraction_gpu(n, r, candidates=["GPU-0", "GPU-2"], policy="bestfit") == "GPU-2"
    assert preferred_fraction_gpu(n, r, candidates=["GPU-0", "GPU-1", "GPU-2"], policy="spread") == "GPU-0"
    assert preferred_fraction_gpu(n, Request(gpu_milli=700), candidates=["GPU-1", "GPU-2"]) is None
    # gpunode without a workload falls back to the tightest fitting GPU
    assert preferred_fraction_gpu(n, r, candidates=["GPU-0", "GPU-1", "GPU-2"]) == "GPU-1"
    with pytest.raises(InvalidRequest):
        preferred_fraction_gpu(n, Request(gpus=1), candidates=["GPU-0"])


# ----- properties over general nodes ------------------------------------------------------------------------------


@st.composite
def general_gpus(draw: st.DrawFn, i: int) -> GpuState:
    sharing = draw(st.sampled_from(["fractional", "fractional", "whole", "mig", "time-sliced"]))
    total = draw(st.sampled_from([0, 16 * GIB, 80 * GIB])) if sharing == "fractional" else 0
    return GpuState(
        uuid=f"GPU-{i}",
        index=i,
        model=draw(st.sampled_from(["A100", "T4"])),
        milli_free=draw(st.sampled_from([0, 100, 250, 500, 999, 1000])) if sharing == "fractional" else 1000,
        memory_total_bytes=total,
        memory_free_bytes=draw(st.integers(0, total)) if total else 0,
        numa_node=draw(st.sampled_from([0, 1, None])),
        healthy=draw(st.integers(0, 4)) > 0,
        mig_free={"1g.10gb": draw(st.integers(0, 3))} if sharing == "mig" else {},
        sharing=sharing,  # type: ignore[arg-type]
    )


@st.composite
def general_nodes(draw: st.DrawFn) -> list[NodeState]:
    nodes = []
    for n in range(draw(st.integers(1, 4))):
        gpus = tuple(draw(general_gpus(i)) for i in range(draw(st.integers(0, 8))))
        gpus = tuple(GpuState(**{**g.__dict__, "uuid": f"n{n}-{g.uuid}"}) for g in gpus)
        nodes.append(
            NodeState(
                name=f"n{n}",
                gpus=gpus,
                cpu_milli_free=draw(st.integers(0, 64_000)),
                memory_free_bytes=draw(st.integers(0, 64 * GIB)),
            )
        )
    return nodes


requests = st.one_of(
    st.builds(Request, cpu_milli=st.integers(0, 8000)),
    st.builds(Request, gpus=st.integers(1, 4), cpu_milli=st.integers(0, 8000)),
    st.builds(Request, gpu_milli=st.integers(1, 999), gpu_memory_bytes=st.sampled_from([0, GIB, 20 * GIB])),
    st.builds(Request, gpu_memory_bytes=st.sampled_from([GIB, 40 * GIB])),
    st.builds(Request, mig_profile=st.just("1g.10gb")),
    st.builds(Request, gpus=st.just(1), gpu_models=st.just(frozenset({"T4"}))),
)


@settings(max_examples=150, deadline=None)
@given(nodes=general_nodes(), request_=requests, policy=st.sampled_from(sorted(POLICIES)))
def test_every_placement_fits_and_never_over_allocates(
    nodes: list[NodeState], request_: Request, policy: str
) -> None:
    placed = place(nodes, request_, policy=policy, workload=WORKLOAD, rng=random.Random(0))
    if placed is None:
        assert not any(fits(n, request_) for n in nodes)
        return
    target = next(n for n in nodes if n.name == placed.node)
    assert fits(target, request_)
    after = apply_request(target, request_, placed.gpu_uuids)  # raises if the GPUs cannot take it
    assert after.cpu_milli_free >= 0 and after.memory_free_bytes >= 0
    for g in after.gpus:
        assert 0 <= g.milli_free <= 1000 and 0 <= g.memory_free_bytes <= g.memory_total_bytes
        assert all(v >= 0 for v in g.mig_free.values())
    used = [target.gpu(u) for u in placed.gpu_uuids]
    if request_.kind == "whole":
        assert len(set(placed.gpu_uuids)) == request_.gpus and all(g.fully_free for g in used)
    if request_.kind == "fraction":
        assert used[0].milli_free >= request_.gpu_milli and used[0].sharing == "fractional"
    if request_.gpu_models:
        assert all(g.model in request_.gpu_models for g in used)


# ----- node pressure (the gpunode policy keeps scarce kinds of node for the pods that need them) -----

# Two kinds of 8-GPU node (96 and 128 cores, 2 nodes each) and one 2-GPU kind (4 nodes): 40 GPUs, 864 cores.
PRESSURE_NODES = (
    NodeCapacity("a1", "G2", 8, 96_000),
    NodeCapacity("a2", "G2", 8, 96_000),
    NodeCapacity("b1", "G3", 8, 128_000),
    NodeCapacity("b2", "G3", 8, 128_000),
    *(NodeCapacity(f"t{i}", "T4", 2, 104_000) for i in range(4)),
)
PRESSURE_DEMAND = (
    TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=1, gpu_models=None, weight=20),
    TargetPod(cpu_milli=120_000, gpu_milli=1000, gpus=8, gpu_models=None, weight=1),
    TargetPod(cpu_milli=64_000, gpu_milli=1000, gpus=8, gpu_models=None, weight=1),
)


def test_node_pressure_hand_worked() -> None:
    """Two kinds of 8-GPU node (96 and 128 cores, 2 nodes each = 16 GPUs each) and one 2-GPU kind (4 nodes = 8 GPUs).

    Demand (GPU-milli weights): a 1-GPU, 8-core shape (weight 20 -> 20,000) fits every
    kind; an 8-GPU, 120-core shape (weight 1 -> 8,000) fits the 128-core kind only;
    an 8-GPU, 64-core shape (weight 1 -> 8,000) fits both 8-GPU kinds. Total 36,000
    against 40 GPUs of capacity, so one unit of demand is 40/36 milli of capacity.
    """
    nodes = PRESSURE_NODES
    demand = PRESSURE_DEMAND
    workload = TargetWorkload(demand[:1]).with_supply(
        {"G2": 16, "G3": 16, "T4": 8}, nodes=nodes, demand=demand
    )
    scale = 40 / 36  # capacity per unit of demand
    # load in GPU-milli per kind, then over its supply (milli)
    g2 = (20_000 * 16 / 40 + 8_000 * 16 / 32) * scale / 16_000
    g3 = (20_000 * 16 / 40 + 8_000 + 8_000 * 16 / 32) * scale / 16_000
    t4 = (20_000 * 8 / 40) * scale / 8_000
    assert workload.node_pressure["a1"] == workload.node_pressure["a2"] == pytest.approx(g2)
    assert workload.node_pressure["b1"] == pytest.approx(g3)
    assert workload.node_pressure["t3"] == pytest.approx(t4)
    assert g3 > g2 > t4
    # full load: demand spread over the kinds adds up to the cluster's capacity
    total = sum(workload.node_pressure[n.name] * n.gpus for n in nodes)
    assert total == pytest.approx(40)
    # the model part is unchanged (no shape restricted to a model) and unknown nodes get none
    assert not workload.model_pressure and workload.pressure("elsewhere", "G2") == 0.0
    assert workload.pressure("b1", "G3") == pytest.approx(g3)
    # without nodes there is no node pressure
    assert not TargetWorkload(demand).with_supply({"G2": 16}).node_pressure


@pytest.mark.parametrize(("cpu_pods", "pressed"), [(108, True), (109, False)], ids=["cpu-fits", "cpu-full"])
def test_node_pressure_is_off_when_the_pods_cpu_would_fill_the_nodes(cpu_pods: int, pressed: bool) -> None:
    """The nodes have 864 cores. GPU shapes ask 344 cores per 36 GPUs of demand, scaled to the 40 GPUs of
    capacity: x 40/36. 4-core CPU-only pods: 108 of them bring the total to 776 x 40/36 = 862.2 cores (fits),
    109 to 780 x 40/36 = 866.7 cores (more than the nodes have: CPU-only pods would take the pressed
    nodes' cores anyway, so there is no node pressure)."""
    nodes = PRESSURE_NODES
    demand = (
        *PRESSURE_DEMAND,
        TargetPod(cpu_milli=4000, gpu_milli=0, gpus=0, gpu_models=None, weight=cpu_pods),
    )
    workload = TargetWorkload(demand).with_supply({"G2": 16, "G3": 16, "T4": 8}, nodes=nodes, demand=demand)
    assert bool(workload.node_pressure) is pressed
    if pressed:  # CPU-only shapes put no GPU load anywhere
        assert sum(workload.node_pressure[n.name] * n.gpus for n in nodes) == pytest.approx(40)


def test_gpunode_keeps_the_only_nodes_of_the_largest_pods_for_them() -> None:
    """A 1-GPU pod goes to the 96-core node, not the 128-core one that alone can run the 120-core 8-GPU pods."""

    def empty(name: str, model: str, cpu: int) -> NodeState:
        gpus = tuple(
            GpuState(f"{name}-{j}", j, model, 1000, 0, 0, None, sharing="fractional") for j in range(8)
        )
        return NodeState(name, gpus, cpu_milli_free=cpu, memory_free_bytes=2**40)

    nodes = [empty("big", "G3", 128_000), empty("usual", "G2", 96_000)]
    demand = (
        TargetPod(cpu_milli=8000, gpu_milli=1000, gpus=1, gpu_models=None, weight=50),
        TargetPod(cpu_milli=120_000, gpu_milli=1000, gpus=8, gpu_models=None, weight=5),
    )
    typical = TargetWorkload(demand[:1])
    capacities = [NodeCapacity(n.name, n.gpus[0].model, 8, n.cpu_milli_free) for n in nodes]
    pressed = typical.with_supply({"G2": 8, "G3": 8}, nodes=capacities, demand=demand)
    assert pressed.node_pressure["big"] > pressed.node_pressure["usual"]
    request = Request(gpus=1, cpu_milli=8000)
    # FGD alone sees no difference (both nodes score the same), node order decides
    big, usual = (score_node(n, request, policy="fgd", workload=typical) for n in nodes)
    assert big is not None and usual is not None and big.score == usual.score
    unpressed = place(nodes, request, policy="gpunode", workload=typical)
    assert unpressed is not None and unpressed.node == "big"  # a tie without node pressure: node order
    chosen = place(nodes, request, policy="gpunode", workload=pressed)
    assert chosen is not None and chosen.node == "usual"
    # the 8-GPU, 120-core pod itself still takes the big node: it fits nowhere else
    chosen = place(nodes, Request(gpus=8, cpu_milli=120_000), policy="gpunode", workload=pressed)
    assert chosen is not None and chosen.node == "big"
