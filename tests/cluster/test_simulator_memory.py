"""The trace simulator with GPU memory: each GPU carries its model's memory and a pod asks memory and compute.

Memory binds (two 0.3-GPU pods of 10 GiB on a 16 GiB GPU), compute binds (two 0.6-GPU pods of
2 GiB), the per-GPU accounting after a memory-heavy pod, the trace column and its errors, the
model table, and a trace without memory asks placing exactly as the compute-only simulation.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from gpunode.cluster.tracesim.gpumemory import (
    DEFAULT_MEMORY_MIB,
    MemoryAsks,
    model_memory_bytes,
    unknown_models,
    unknown_notice,
)
from gpunode.cluster.tracesim.simulate import load_trace, simulate_seed
from gpunode.cluster.tracesim.trace import (
    TraceNode,
    TracePod,
    load_pods,
    node_state,
    request_of,
    target_workload,
)
from gpunode.contract.names import GIB, MIB
from gpunode.errors import TraceError
from gpunode.placement.batch import ClusterArrays
from tests.cluster.test_simulator import write_trace

V100 = TraceNode(name="n1", cpu_milli=64000, memory_bytes=256 * GIB, gpus=1, model="V100M16")
POD_COLUMNS = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "gpu_memory_mib"]


def shared(name: str, milli: int, gpu_memory_gib: int = 0) -> TracePod:
    return TracePod(
        name=name,
        cpu_milli=1000,
        memory_bytes=GIB,
        num_gpu=1,
        gpu_milli=milli,
        gpu_models=None,
        gpu_memory_bytes=gpu_memory_gib * GIB,
    )


def replay(pods: list[TracePod], nodes: list[TraceNode], ratio: float) -> tuple[int, float]:
    """(failed, allocated % at the end) of one seed whose arrivals are exactly `pods` (ratio chosen so)."""
    r = simulate_seed(
        nodes=nodes, pods=pods, workload=target_workload(pods), policy="bestfit", seed=1, ratio=ratio
    )
    assert r.arrivals == len(pods)
    return r.failed, r.allocated_pct[-1]


def test_memory_binds_where_compute_does_not() -> None:
    # 0.3 + 0.3 GPU of compute fit one GPU; 10 + 10 GiB do not fit its 16 GiB: the second fails.
    pods = [shared("a", 300, 10), shared("b", 300, 10)]
    assert replay(pods, [V100], ratio=0.6) == (1, pytest.approx(30.0))
    # The same compute without memory asks (its share of 16 GiB, 4.8 GiB each) fits: both placed.
    assert replay([shared("a", 300), shared("b", 300)], [V100], ratio=0.6) == (0, pytest.approx(60.0))


def test_compute_binds_where_memory_does_not() -> None:
    # 2 + 2 GiB fit 16 GiB; 0.6 + 0.6 GPU do not fit one GPU: the second fails.
    pods = [shared("a", 600, 2), shared("b", 600, 2)]
    assert replay(pods, [V100], ratio=1.2) == (1, pytest.approx(60.0))


@pytest.mark.parametrize("policy", ["bestfit", "fgd", "gpunode", "packing"])
def test_memory_bound_pod_goes_to_another_gpu_and_the_gpu_counts_both(policy: str) -> None:
    node = TraceNode(name="n1", cpu_milli=64000, memory_bytes=256 * GIB, gpus=2, model="V100M16")
    pods = [shared("a", 300, 10), shared("b", 300, 10)]
    cluster = ClusterArrays([node_state(node)], workload=target_workload(pods))
    asks = MemoryAsks([node.model])
    rng = np.random.default_rng(0)
    slots = []
    for p in pods:
        choice = cluster.choose(request_of(p, asks), policy, rng=rng)
        assert choice is not None
        cluster.apply(request_of(p, asks), choice.node, choice.gpus)
        slots.extend(choice.gpus)
    assert sorted(slots) == [0, 1]  # a compute-first policy would stack both on one GPU
    for gpu in cluster.node_state(0).gpus:
        assert gpu.milli_free == 700 and gpu.memory_free_bytes == 6 * GIB
        # what is left to place is bound by memory: 6 of 16 GiB is 375 milli, not the 700 of compute
        assert gpu.free_share_milli == 375
    assert cluster.allocated_gpu_milli() == 2 * 625


def test_the_trace_column_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    rows = [
        ["s", 1000, 1024, 1, 300, "", 10240],
        ["p", 1000, 1024, 1, 300, "", ""],
        ["w", 1000, 1024, 2, 1000, "", ""],
    ]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([POD_COLUMNS, *rows])
    s, p, w = load_pods(path)
    assert (s.gpu_memory_bytes, p.gpu_memory_bytes, w.gpu_memory_bytes) == (10240 * MIB, 0, 0)
    asks = MemoryAsks(["V100M32", "T4"])
    assert request_of(s, asks).gpu_memory_bytes == 10 * GIB
    assert request_of(p, asks).gpu_memory_bytes == 300 * 15360 * MIB // 1000  # the smallest GPU, a T4
    assert request_of(p).gpu_memory_bytes == 0  # compute only without `asks`
    assert request_of(w, asks).gpus == 2 and request_of(w, asks).gpu_memory_bytes == 0
    for row, message in (
        (["c", 1000, 1024, 0, 0, "", 512], "a pod asking no GPU cannot ask GPU memory"),
        (["x", 1000, 1024, 1, 1000, "", 512], "a whole-GPU pod holds all of its GPUs' memory"),
        (["n", 1000, 1024, 1, 300, "", -5], "cannot be negative"),
    ):
        with path.open("w", newline="") as f:
            csv.writer(f).writerows([POD_COLUMNS, row])
        with pytest.raises(TraceError, match=message) as err:
            load_pods(path)
        assert f"{path}:2" in str(err.value)


def test_model_table() -> None:
    assert model_memory_bytes("V100M16") == 16 * GIB and model_memory_bytes("V100M32") == 32 * GIB
    assert model_memory_bytes("T4") == 15360 * MIB  # as the simulated node profile t4.yaml
    assert model_memory_bytes("NVIDIA A100-SXM4-80GB") == 81920 * MIB  # by one word of the name
    assert model_memory_bytes("G2") == DEFAULT_MEMORY_MIB * MIB
    assert unknown_models(["G2", "T4", "G3", "G2", ""]) == ("G2", "G3")
    notice = unknown_notice(["G3", "G2", "P100"])
    assert notice is not None and "G2, G3" in notice and "16 GiB" in notice and "\n" not in notice
    assert unknown_notice(["P100", "A10"]) is None
    asks = MemoryAsks(["V100M32", "T4", "A10"])
    assert asks.ask(500, frozenset({"V100M32"})) == 16 * GIB
    assert asks.ask(500, frozenset({"V100M32", "A10"})) == 12 * GIB
    assert asks.ask(500, frozenset({"P100"})) == 0  # no GPU of the cluster takes it


def _with_memory_column(folder: Path, mib_of: dict[str, int]) -> None:
    """Rewrite the pod list with a gpu_memory_mib column: the given MiB per fractional shape's gpu_milli."""
    path = folder / "csv" / "openb_pod_list_default.csv"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0].keys(), "gpu_memory_mib"])
        w.writeheader()
        for row in rows:
            milli = int(row["gpu_milli"])
            row["gpu_memory_mib"] = str(mib_of[row["name"]]) if 0 < milli < 1000 else ""
            w.writerow(row)


@pytest.mark.parametrize("policy", ["fgd", "bestfit", "packing", "dotprod", "random", "gpunode", "spread"])
def test_a_trace_without_memory_asks_places_as_the_compute_only_simulation(
    tmp_path: Path, policy: str
) -> None:
    # The openb mix (G2, T4, P100 nodes; shared, whole, multi-GPU, CPU and typed pods) three ways: compute
    # only (GPUs without memory, as before GPU memory was simulated), with memory and no asks (each pod asks
    # its compute share of the smallest GPU it may use), and with those asks written in the trace.
    plain = load_trace(write_trace(tmp_path / "plain"), "default")
    explicit_dir = write_trace(tmp_path / "explicit")
    smallest = 15360  # the T4's MiB: no GPU of this trace is smaller
    _with_memory_column(explicit_dir, {p.name: p.gpu_milli * smallest // 1000 for p in plain.pods})
    explicit = load_trace(explicit_dir, "default")
    assert any(p.gpu_memory_bytes for p in explicit.pods)
    runs = []
    for trace, gpu_memory in ((plain, False), (plain, True), (explicit, True)):
        r = simulate_seed(
            nodes=trace.nodes,
            pods=trace.pods,
            workload=trace.workload,
            policy=policy,
            seed=42,
            gpu_memory=gpu_memory,
        )
        runs.append((r.failed, r.arrived_pct, r.allocated_pct, r.unallocated_at_100))
    assert runs[0][0] > 0  # the cluster fills: placement decisions matter
    assert runs[0] == runs[1] == runs[2]


def test_explicit_asks_larger_than_the_share_change_the_result(tmp_path: Path) -> None:
    # The comparison above can fail: asks of a whole T4's memory leave room for one shared pod per GPU.
    plain = load_trace(write_trace(tmp_path / "plain"), "default")
    heavy_dir = write_trace(tmp_path / "heavy")
    _with_memory_column(heavy_dir, {p.name: 15360 for p in plain.pods})
    heavy = load_trace(heavy_dir, "default")
    base, more = (
        simulate_seed(nodes=t.nodes, pods=t.pods, workload=t.workload, policy="bestfit", seed=42)
        for t in (plain, heavy)
    )
    assert more.failed > base.failed
