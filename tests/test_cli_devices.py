"""`gpunode devices`: what a node would advertise and why, as a table or JSON, and how it fails.

Runs the real command (gpunode.cli.main) in-process on the bundled simulated nodes; nothing is
served, so no sockets are needed. The environment is cleared of every variable gpunode reads, so
a developer's MIG_STRATEGY or CONFIG_FILE cannot change the outcome.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpunode import cli
from gpunode.config.agent import environment_variables
from gpunode.errors import GpunodeError
from gpunode.node.devices.select import detect_backend
from gpunode.node.devices.simnode.backend import SimBackend

EXAMPLES = Path(__file__).resolve().parents[1] / "gpunode" / "examples"
INVALID = Path(__file__).parent / "data" / "configs" / "invalid"
COLUMNS = ("RESOURCE", "DEVICE ID", "GPU", "KIND", "NUMA", "CAP", "WHY")

A100_MIXED = {
    "nvidia.com/mig-1g.10gb": 19,
    "nvidia.com/mig-2g.20gb": 6,
    "nvidia.com/mig-3g.40gb": 4,
    "nvidia.com/mig-4g.40gb": 1,
    "nvidia.com/gpu": 1,
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for names in environment_variables().values():
        for name in names:
            monkeypatch.delenv(name, raising=False)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["devices", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def parse_table(out: str) -> list[dict[str, str]]:
    """Rows of the table as dicts, cut at the header's column offsets (WHY may contain spaces)."""
    lines = out.rstrip("\n").splitlines()
    header = lines[0]
    starts = [header.index(c) for c in COLUMNS]
    assert starts == sorted(starts), header
    bounds = [*starts[1:], None]
    return [
        {c: line[s:e].strip() for c, s, e in zip(COLUMNS, starts, bounds, strict=True)} for line in lines[1:]
    ]


def sim_gpu_uuids(profile: str) -> list[str]:
    backend = SimBackend.from_profile(profile)
    try:
        return [g.uuid for g in backend.gpus()]
    finally:
        backend.close()


PROFILES = [
    pytest.param("dgx-h100", [], {"nvidia.com/gpu": 8}, id="dgx-h100"),
    pytest.param("t4", [], {"nvidia.com/gpu": 4}, id="t4"),
    pytest.param("a100-mig", ["--mig-strategy", "mixed"], A100_MIXED, id="a100-mig-mixed"),
    pytest.param("a100-mig", [], {"nvidia.com/gpu": 8}, id="a100-mig-none"),
    pytest.param("h100-mig", ["--mig-strategy", "single"], {"nvidia.com/gpu": 56}, id="h100-mig-single"),
]


@pytest.mark.parametrize(("profile", "extra", "expected"), PROFILES)
def test_table(
    capsys: pytest.CaptureFixture[str], profile: str, extra: list[str], expected: dict[str, int]
) -> None:
    code, out, err = run(capsys, "--backend", "sim", "--sim-profile", profile, *extra)
    assert code == 0, err
    rows = parse_table(out)
    assert dict(Counter(r["RESOURCE"] for r in rows)) == expected
    uuids = sim_gpu_uuids(profile)
    for row in rows:
        assert row["WHY"], row
        assert row["KIND"] in ("gpu", "mig")
        assert row["CAP"] == "-"
        assert row["NUMA"] in ("0", "1")
        gpu_index = int(row["GPU"])
        if row["KIND"] == "gpu":
            assert row["DEVICE ID"] == uuids[gpu_index]
        else:
            assert row["DEVICE ID"].startswith("MIG-")
            assert f"on GPU {gpu_index}" in row["WHY"]


def test_table_warnings_go_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--backend", "sim", "--sim-profile", "a100-mig")
    assert code == 0
    assert "warning: migStrategy none: GPU(s) 0, 1, 2, 3, 4, 5, 6 have MIG enabled" in err
    assert "warning" not in out


@pytest.mark.parametrize(("profile", "extra", "expected"), PROFILES)
def test_json(
    capsys: pytest.CaptureFixture[str], profile: str, extra: list[str], expected: dict[str, int]
) -> None:
    code, out, err = run(capsys, "--backend", "sim", "--sim-profile", profile, "--json", *extra)
    assert code == 0, err
    doc = json.loads(out)
    devices = doc["devices"]
    assert dict(Counter(d["resource"] for d in devices)) == expected
    uuids = sim_gpu_uuids(profile)
    assert list(doc["modes"]) == uuids
    assert len({d["id"] for d in devices}) == len(devices)
    for d in devices:
        assert set(d) == {
            "resource",
            "id",
            "kind",
            "gpu_index",
            "gpu_uuid",
            "mig_uuid",
            "numa_node",
            "memory_cap_bytes",
            "reason",
        }
        assert d["gpu_uuid"] == uuids[d["gpu_index"]]
        assert d["id"] == (d["mig_uuid"] or d["gpu_uuid"])
        assert d["reason"]
    assert isinstance(doc["warnings"], list)


@pytest.mark.parametrize(
    ("example", "profile", "check"),
    [
        pytest.param(
            "config-timeslicing.yaml",
            "t4",
            {"nvidia.com/gpu.shared": ("replica", 8, 3840 * 2**20), "nvidia.com/gpu": ("gpu", 2, None)},
            id="timeslicing-on-t4",
        ),
        pytest.param(
            "config-fractional.yaml",
            "t4",
            {"gpunode.io/gpu-memory": ("memory", 60, 2**30)},
            id="fractional-on-t4",
        ),
        pytest.param(
            "config-mig-mixed.yaml",
            "h100-mig",
            {"nvidia.com/mig-1g.10gb.shared": ("replica", 112, None)},
            id="mig-mixed-on-h100-mig",
        ),
    ],
)
def test_json_with_an_example_config(
    capsys: pytest.CaptureFixture[str], example: str, profile: str, check: dict[str, tuple[str, int, Any]]
) -> None:
    code, out, err = run(
        capsys, "--backend", "sim", "--sim-profile", profile, "--config", str(EXAMPLES / example), "--json"
    )
    assert code == 0, err
    devices = json.loads(out)["devices"]
    assert {d["resource"] for d in devices} == set(check)
    for resource, (kind, count, cap) in check.items():
        mine = [d for d in devices if d["resource"] == resource]
        assert len(mine) == count
        assert {d["kind"] for d in mine} == {kind}
        assert {d["memory_cap_bytes"] for d in mine} == {cap}
        if kind == "replica":
            assert all(
                d["id"] == f"{d['mig_uuid'] or d['gpu_uuid']}::{d['id'].rsplit('::', 1)[1]}" for d in mine
            )
        if kind == "memory":
            assert all(d["id"].startswith(f"{d['gpu_uuid']}::mem") for d in mine)


def test_table_shows_caps_in_gibibytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "--backend",
        "sim",
        "--sim-profile",
        "t4",
        "--config",
        str(EXAMPLES / "config-timeslicing.yaml"),
    )
    assert code == 0
    caps = {r["RESOURCE"]: r["CAP"] for r in parse_table(out)}
    assert caps == {"nvidia.com/gpu.shared": "3.8Gi", "nvidia.com/gpu": "-"}


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "fragments"),
    [
        pytest.param(
            ["--config", str(INVALID / "replicas-one.yaml")],
            {},
            [
                f"{INVALID / 'replicas-one.yaml'}: sharing.timeSlicing.resources[0].replicas: must be at least 2"
            ],
            id="invalid-file",
        ),
        pytest.param(
            ["--config", "/nonexistent/gpunode.yaml"],
            {},
            ["/nonexistent/gpunode.yaml: configuration file not found (named by --config)"],
            id="missing-file",
        ),
        pytest.param(
            [],
            {"CONFIG_FILE": str(INVALID / "version-v2.yaml")},
            ["version: only v1 is supported, got 'v2'"],
            id="invalid-file-named-by-variable",
        ),
        pytest.param(
            ["--sim-profile", "a100-mig", "--mig-strategy", "single"],
            {},
            ["command line --mig-strategy: single needs MIG enabled on every GPU"],
            id="mig-single-on-a-mixed-node",
        ),
        pytest.param(
            ["--sim-profile", "a100-mig"],
            {"MIG_STRATEGY": "single"},
            ["environment variable MIG_STRATEGY: single needs MIG enabled on every GPU"],
            id="mig-single-from-the-environment",
        ),
        pytest.param(
            [],
            {"FAIL_ON_INIT_ERROR": "sometimes"},
            ["environment variable FAIL_ON_INIT_ERROR: expected true or false, got 'sometimes'"],
            id="bad-variable",
        ),
    ],
)
def test_configuration_error_exits_2_with_a_hint(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    fragments: list[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = run(capsys, "--backend", "sim", *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("gpunode: ")
    for fragment in fragments:
        assert fragment in err
    hint_lines = [line for line in err.splitlines() if line.startswith("HINT: ")]
    assert len(hint_lines) == 1 and len(hint_lines[0]) > len("HINT: ")
    assert err.splitlines() == [err.splitlines()[0], hint_lines[0]]  # the message is one line, then the hint
    assert "Traceback" not in err


def test_unknown_profile_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--backend", "sim", "--sim-profile", "dgx-b300")
    assert code == 2 and out == ""
    assert "dgx-b300" in err and "\nHINT: " in err


def nvml_loads() -> bool:
    """Whether this machine has a working NVIDIA driver (then the no-GPU test does not apply)."""
    try:
        backend = detect_backend("nvml")
    except GpunodeError:
        return False
    backend.close()
    return True


@pytest.mark.skipif(nvml_loads(), reason="NVML works here; this test is for nodes without an NVIDIA driver")
@pytest.mark.parametrize("backend", ["nvml", "auto"])
def test_no_gpu_here_exits_1_and_suggests_the_simulator(
    capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    code, out, err = run(capsys, "--backend", backend)
    assert code == 1
    assert out == ""
    assert err.startswith("gpunode: ")
    assert "HINT: " in err and "--backend sim" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--backend", "rocm"], id="unknown-backend"),
        pytest.param(["--mig-strategy", "auto"], id="unknown-mig-strategy"),
    ],
)
def test_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["devices", *argv])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
