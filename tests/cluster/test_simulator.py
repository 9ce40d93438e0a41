"""The trace simulator: trace reading, the arrival protocol, determinism per seed, outputs and the CLI."""

from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest

from gpunode.cluster.tracesim.simulate import (
    SimulationSpec,
    load_trace,
    parse_seeds,
    register_simulate_cli,
    run_simulate_cli,
    run_simulation,
    simulate_seed,
    unallocated_at,
    write_outputs,
)
from gpunode.cluster.tracesim.trace import TracePod, build_arrivals, load_nodes, load_pods, target_workload
from gpunode.errors import ConfigError, GpunodeError, TraceError
from tests.cluster.timesim.helpers import NODE_HEADER, POD_HEADER


def write_trace(folder: Path, *, nodes: int = 48, pods: int = 320, seed: int = 5) -> Path:
    """A small openb-format trace with the openb mix: shared, whole, multi-GPU, CPU-only and typed pods."""
    rng = random.Random(seed)
    csv_dir = folder / "csv"
    csv_dir.mkdir(parents=True)
    kinds = [("G2", 8, 96000, 393216), ("T4", 2, 104000, 524288), ("P100", 2, 64000, 262144)]
    with (csv_dir / "openb_node_list_gpu_node.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(NODE_HEADER)
        for i in range(nodes):
            model, gpus, cpu, mem = kinds[0] if i % 3 else kinds[1 + (i // 3) % 2]
            w.writerow([f"node-{i:03d}", cpu, mem, gpus, model])
    shapes = [
        (12000, 16384, 1, 1000, ""),
        (6000, 12288, 1, 460, ""),
        (3152, 8192, 1, 810, ""),
        (4000, 8192, 1, 320, "T4"),
        (11908, 30000, 1, 470, ""),
        (16000, 65536, 0, 0, ""),
        (88000, 327680, 8, 1000, ""),
        (24000, 65536, 2, 1000, "G2|P100"),
        (8000, 32768, 1, 650, ""),
    ]
    weights = [20, 12, 25, 6, 10, 12, 1, 2, 8]
    with (csv_dir / "openb_pod_list_default.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(POD_HEADER)
        for i in range(pods):
            cpu, mem, n, milli, spec = rng.choices(shapes, weights)[0]
            w.writerow([f"pod-{i:04d}", cpu, mem, n, milli, spec, "LS", "Running", i, "", i])
    return folder


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_trace(tmp_path_factory.mktemp("openb"))


# ----- trace input -----------------------------------------------------------------------------------------------


def test_load_trace(trace_dir: Path) -> None:
    trace = load_trace(trace_dir, "default")
    assert len(trace.nodes) == 48 and len(trace.pods) == 320
    g2 = next(n for n in trace.nodes if n.model == "G2")
    assert (g2.gpus, g2.cpu_milli, g2.memory_bytes) == (8, 96000, 393216 * 2**20)
    typed = next(p for p in trace.pods if p.gpu_models)
    assert typed.gpu_models in (frozenset({"T4"}), frozenset({"G2", "P100"}))
    assert any(p.num_gpu == 0 and p.gpu_models is None for p in trace.pods)
    assert trace.workload.model_pressure  # typed shapes put pressure on their models
    # every node gets its kind's pressure; one value per kind (G2 8x96, T4 2x104, P100 2x64)
    pressure = trace.workload.node_pressure
    assert set(pressure) == {n.name for n in trace.nodes}
    assert len({round(v, 9) for v in pressure.values()}) == 3
    assert sum(pressure[n.name] * n.gpus for n in trace.nodes) == pytest.approx(
        sum(n.gpus for n in trace.nodes)
    )


@pytest.mark.parametrize(
    ("header", "row", "message"),
    [
        pytest.param(NODE_HEADER[:-1], ["n", 1, 1, 1], "missing column(s) model", id="missing-column"),
        pytest.param(NODE_HEADER, ["n", "lots", 1, 1, "T4"], "expected a number", id="not-a-number"),
        pytest.param(NODE_HEADER, ["n", -1, 1, 1, "T4"], "cannot be negative", id="negative"),
        pytest.param(NODE_HEADER, ["n", 1, 1, 16, "T4"], "at most 8 GPUs", id="too-many-gpus"),
        pytest.param(NODE_HEADER, ["n", 1, 1, 2, ""], "needs a model", id="gpus-without-model"),
    ],
)
def test_bad_node_lists(tmp_path: Path, header: list[str], row: list[object], message: str) -> None:
    path = tmp_path / "nodes.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([header, row])
    with pytest.raises(TraceError) as err:
        load_nodes(path)
    assert message in str(err.value) and err.value.hint


@pytest.mark.parametrize(
    ("row", "message"),
    [
        pytest.param(["p", 1000, 10, 9, 1000], "num_gpu above 8", id="too-many-gpus"),
        pytest.param(["p", 1000, 10, 2, 500], "must ask for whole GPUs", id="multi-fraction"),
    ],
)
def test_bad_pod_lists(tmp_path: Path, row: list[object], message: str) -> None:
    path = tmp_path / "pods.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"], row])
    with pytest.raises(TraceError, match=message):
        load_pods(path)


def test_missing_files_are_trace_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path, "default")
    empty = tmp_path / "empty.csv"
    empty.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n")
    with pytest.raises(TraceError, match="no pods"):
        load_pods(empty)


def pod(name: str, cpu: int, milli: int, num: int = 1) -> TracePod:
    return TracePod(
        name=name,
        cpu_milli=cpu,
        memory_bytes=0,
        num_gpu=num if milli else 0,
        gpu_milli=milli,
        gpu_models=None,
    )


def test_target_workload_takes_the_most_frequent_shapes() -> None:
    pods = [pod(f"a{i}", 1000, 500) for i in range(50)] + [pod(f"b{i}", 2000, 1000) for i in range(30)]
    pods += [pod(f"c{i}", 3000, 0) for i in range(15)] + [pod(f"d{i}", 4000, 250) for i in range(5)]
    workload = target_workload(pods)  # 95% of 100 pods: a (50) + b (30) + c (15) = 95
    assert [(t.cpu_milli, t.gpu_milli, t.weight) for t in workload.pods] == [
        (1000, 500, 50),
        (2000, 1000, 30),
        (3000, 0, 15),
    ]


def test_arrivals_are_tuned_up_and_down_to_the_ratio() -> None:
    from gpunode.cluster.tracesim.trace import TraceNode

    nodes = [TraceNode("n", 64000, 2**30, 4, "T4")]  # 4000 milli of GPU capacity
    small = [pod(f"p{i}", 1000, 500) for i in range(4)]  # 2000 milli
    up = build_arrivals(small, nodes=nodes, seed=1, ratio=1.3)
    total = sum(p.total_gpu_milli for p in up.pods)
    assert 5200 - 500 < total <= 5200 and len(up.pods) > 4
    assert sorted(p.name for p in up.pods[:4]) == sorted(
        p.name for p in small
    )  # the shuffled originals first
    big = [pod(f"q{i}", 1000, 1000) for i in range(9)]  # 9000 milli
    down = build_arrivals(big, nodes=nodes, seed=1, ratio=1.3)
    assert sum(p.total_gpu_milli for p in down.pods) <= 5200 and len(down.pods) == 5
    assert build_arrivals(small, nodes=nodes, seed=1).pods == up.pods
    assert build_arrivals(small, nodes=nodes, seed=2).pods != up.pods


# ----- simulation ------------------------------------------------------------------------------------------------


def test_same_seed_same_result_and_seeds_differ(trace_dir: Path) -> None:
    trace = load_trace(trace_dir, "default")
    kw = dict(nodes=trace.nodes, pods=trace.pods, workload=trace.workload)
    for policy in ("gpunode", "fgd", "random"):
        a = simulate_seed(policy=policy, seed=3, **kw)  # type: ignore[arg-type]
        b = simulate_seed(policy=policy, seed=3, **kw)  # type: ignore[arg-type]
        c = simulate_seed(policy=policy, seed=4, **kw)  # type: ignore[arg-type]
        assert (a.arrived_pct, a.allocated_pct, a.unallocated_at_100) == (
            b.arrived_pct,
            b.allocated_pct,
            b.unallocated_at_100,
        )
        assert a.arrived_pct != c.arrived_pct
        arrived, allocated = np.array(a.arrived_pct), np.array(a.allocated_pct)
        assert (np.diff(arrived) >= 0).all() and (np.diff(allocated) >= 0).all()
        assert (allocated <= arrived + 1e-9).all() and allocated[-1] <= 100.0
        assert 125 < arrived[-1] <= 130.0 + 1e-9


def test_parallel_runs_equal_serial_runs(trace_dir: Path) -> None:
    spec = SimulationSpec(trace_dir=trace_dir, policies=("fgd", "gpunode"), seeds=(1, 2), jobs=1)
    serial = run_simulation(spec, progress=False)
    parallel = run_simulation(
        SimulationSpec(trace_dir=trace_dir, policies=("fgd", "gpunode"), seeds=(1, 2), jobs=2), progress=False
    )
    assert [(r.policy, r.seed, r.allocated_pct) for r in serial] == [
        (r.policy, r.seed, r.allocated_pct) for r in parallel
    ]


@pytest.mark.parametrize(
    ("arrived", "allocated", "expected"),
    [
        pytest.param([99.4, 99.6, 100.2, 100.6], [95.0, 96.0, 97.0, 97.0], 100 - 96.5, id="bucket-100"),
        pytest.param([98.0, 101.2], [90.0, 92.0], 100 - 92.0, id="nearest-within-one"),
        pytest.param([10.0, 20.0], [10.0, 20.0], float("nan"), id="never-reached"),
    ],
)
def test_unallocated_at_100(arrived: list[float], allocated: list[float], expected: float) -> None:
    got = unallocated_at(np.array(arrived), np.array(allocated))
    assert (np.isnan(got) and np.isnan(expected)) or got == pytest.approx(expected)


def test_outputs_csv_png_and_summary(trace_dir: Path, tmp_path: Path) -> None:
    spec = SimulationSpec(trace_dir=trace_dir, policies=("bestfit", "gpunode"), seeds=(1,), jobs=1)
    results = run_simulation(spec, progress=False)
    paths = write_outputs(results, tmp_path / "out", name="default")
    rows = list(csv.DictReader(paths["csv"].open()))
    assert set(rows[0]) == {"pods", "policy", "seed", "arrived_pct", "allocated_pct", "unallocated_pct"}
    assert {r["policy"] for r in rows} == {"bestfit", "gpunode"}
    assert all(abs(float(r["allocated_pct"]) + float(r["unallocated_pct"]) - 100) < 1e-6 for r in rows)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(paths["summary"].read_text())
    assert set(summary["policies"]) == {"bestfit", "gpunode"}
    assert summary["per_seed"][0]["arrivals"] == results[0].arrivals


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("42-45", (42, 43, 44, 45)), ("7", (7,)), ("1,3-4,1", (1, 3, 4)), (" 2 , 5 ", (2, 5))],
)
def test_parse_seeds(text: str, seeds: tuple[int, ...]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "5-2", "1,,2", "-3"])
def test_parse_seeds_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_seeds(text)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"policies": ("tetris",)}, id="unknown-policy"),
        pytest.param({"jobs": 0}, id="no-jobs"),
        pytest.param({"ratio": 0.0}, id="zero-ratio"),
        pytest.param({"seeds": ()}, id="no-seeds"),
    ],
)
def test_bad_specs(trace_dir: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(GpunodeError):
        SimulationSpec(trace_dir=trace_dir, **kwargs)  # type: ignore[arg-type]


def test_cli(trace_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpunode")
    register_simulate_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "simulate",
            "--trace-dir",
            str(trace_dir),
            "--pods",
            "default",
            "--policies",
            "fgd,gpunode",
            "--seeds",
            "1-2",
            "--out",
            str(tmp_path / "o"),
            "--jobs",
            "1",
            "--progress",
            "off",
        ]
    )
    assert run_simulate_cli(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["summary"]) == {"fgd", "gpunode"} and printed["summary"]["fgd"]["seeds"] == 2
    assert Path(printed["files"]["png"]).is_file() and Path(printed["files"]["csv"]).is_file()
    bad = parser.parse_args(
        ["simulate", "--trace-dir", str(trace_dir), "--policies", "fgd,nope", "--out", "x"]
    )
    with pytest.raises(ConfigError, match="nope"):
        run_simulate_cli(bad)
