"""`gpunode simulate --mode time` end to end on a tiny trace, and its refusals; the place mode stays the default."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from gpunode.cli import main
from gpunode.cluster.timesim.cli import TimeSpec, parse_loads, run_time_cli, run_time_simulation
from gpunode.cluster.timesim.rules import SimRules
from gpunode.cluster.tracesim.simulate import register_simulate_cli
from gpunode.errors import ConfigError

from .helpers import QUEUES_YAML, pod, write_trace


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    rows = [pod(f"p{i:02d}", 1 + 3 * (i % 5 == 0), i * 30, i * 30 + 200 + 40 * i, i * 30) for i in range(24)]
    rows += [pod(f"u{i}", 1, i * 50, i * 50 + 20, None, qos="BE") for i in range(4)]
    rows.append(pod("cpu", 0, 5, 900, 5))
    return write_trace(tmp_path / "trace", rows, nodes=[("n1", 4), ("n2", 4), ("n3", 2)])


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES_YAML)
    rules = tmp_path / "rules.yaml"
    rules.write_text("replay: {horizon: 10m, maxJobs: 2000}\nqueues: {teams: {team-a: 1, team-b: 1}}\n")
    return queues, rules


def _args(trace: Path, files: tuple[Path, Path], out: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_simulate_cli(parser.add_subparsers(dest="command"))
    queues, rules = files
    return parser.parse_args(
        ["simulate", "--mode", "time", "--trace-dir", str(trace), "--out", str(out), "--queues", str(queues),
         "--rules", str(rules), "--seeds", "1,2", "--load", "0.6,1.1", "--jobs", "1", "--progress", "off",
         *extra]
    )  # fmt: skip


def test_time_mode_writes_csv_json_and_plots(
    trace: Path, files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args(trace, files, tmp_path / "out", "--policies", "gpunode,kube")
    assert run_time_cli(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["summary"]) == {"0.6", "1.1"}
    assert set(printed["summary"]["1.1"]) == {"gpunode", "kube"}
    summary = json.loads((tmp_path / "out" / "time-default-summary.json").read_text())
    mean = summary["1.1"]["gpunode"]["mean"]
    assert summary["1.1"]["gpunode"]["seeds"] == [1, 2]
    assert len(summary["1.1"]["gpunode"]["per_seed"]["delay_mean"]) == 2
    assert mean["jobs"] > 0 and 0 < mean["allocation"] <= 1
    assert summary["1.1"]["gpunode"]["replay"]["offered_load"] == pytest.approx(1.1, rel=1e-6)
    with (tmp_path / "out" / "time-default.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["queue"] for r in rows} == {"all", "team-a", "team-b"}
    assert len(rows) == 2 * 2 * 2 * 3  # loads x policies x seeds x (all + 2 queues)
    pytest.importorskip("matplotlib")
    for name in ("allocation", "wait-cdf", "shares"):
        assert (tmp_path / "out" / f"time-default-{name}.png").stat().st_size > 1000


def test_seeds_run_in_parallel_with_the_same_numbers(trace: Path, files: tuple[Path, Path]) -> None:
    queues, rules = files
    spec = TimeSpec(
        trace_dir=trace, loads=(1.0,), policies=("gpunode",), seeds=(1, 2), rules=rules, queues=queues
    )
    one = run_time_simulation(spec, progress=False)
    two = run_time_simulation(TimeSpec(**{**spec.__dict__, "jobs": 2}), progress=False)
    assert [json.dumps(r.metrics, sort_keys=True) for r in one] == [
        json.dumps(r.metrics, sort_keys=True) for r in two
    ]


def test_rules_naming_queues_the_file_lacks_are_refused(trace: Path, files: tuple[Path, Path]) -> None:
    queues, _ = files
    spec = TimeSpec(trace_dir=trace, policies=("kube",), queues=queues)  # default rules: team-a..team-d
    assert SimRules().queues.names() == ("team-a", "team-b", "team-c", "team-d")
    with pytest.raises(ConfigError, match="team-c, team-d, which the queue file has no leaf queue for"):
        run_time_simulation(spec, progress=False)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"policies": ("slurm",)}, "unknown preset slurm"),
        ({"loads": (0.0,)}, "each load must be within"),
        ({"seeds": ()}, "need at least one entry"),
    ],
)
def test_bad_specs(trace: Path, spec: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TimeSpec(trace_dir=trace, **spec)  # type: ignore[arg-type]


def test_bad_load_text() -> None:
    assert parse_loads("0.9,1.2,0.9") == (0.9, 1.2)
    with pytest.raises(ConfigError, match="--load: expected numbers"):
        parse_loads("high")


def test_gpunode_simulate_time_mode_from_the_command_line(
    trace: Path, files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    queues, rules = files
    code = main(
        ["simulate", "--mode", "time", "--trace-dir", str(trace), "--out", str(tmp_path / "o"),
         "--queues", str(queues), "--rules", str(rules), "--seeds", "3", "--policies", "kueue-strict",
         "--jobs", "1", "--progress", "off"]
    )  # fmt: skip
    assert code == 0
    assert "kueue-strict" in json.loads(capsys.readouterr().out)["summary"]["0.9"]
    bad = main(["simulate", "--mode", "time", "--trace-dir", str(trace), "--out", str(tmp_path / "o"),
                "--queues", str(queues), "--seeds", "3", "--progress", "off", "--jobs", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert bad == 2 and "no leaf queue for" in err and "Traceback" not in err
