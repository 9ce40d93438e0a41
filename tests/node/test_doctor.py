"""`gpunode doctor`: every check reports, with a hint when it fails; the exit status follows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpunode import cli
from gpunode.node.doctor import FAIL, OK, WARN, checks
from tests.agentrunner import make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn


def by_name(results: list) -> dict:
    return {c.name: c for c in results}


def test_healthy_simulated_node_with_a_kubelet(sockdir: Path, kubelet: KubeletStandIn) -> None:
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", backend="sim", simProfile="a100-mig",
                      podResourcesSocket=str(sockdir / "pr.sock"))  # fmt: skip
    with PodResourcesStandIn(str(sockdir / "pr.sock")):
        results = by_name(checks(cfg))
    assert results["gpu backend"].status == OK and "sim:a100-mig: 8 GPU(s)" in results["gpu backend"].detail
    assert "MIG enabled" in results["gpu backend"].detail
    assert results["kubelet"].status == OK and "answers" in results["kubelet"].detail
    assert results["pod-resources"].status == OK
    assert results["memory caps"].status == OK and "libgpunode-preload.so" in results["memory caps"].detail
    assert results["advertised devices"].status in (OK, WARN)


@pytest.mark.parametrize(
    ("name", "status", "fragment"),
    [
        pytest.param("kubelet", WARN, "no ", id="no-kubelet-socket"),
        pytest.param("pod-resources", WARN, "no ", id="no-pod-resources"),
    ],
)
def test_missing_kubelet_parts_are_warnings(sockdir: Path, name: str, status: str, fragment: str) -> None:
    (sockdir / "device-plugins").mkdir()
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", backend="sim",
                      podResourcesSocket=str(sockdir / "missing.sock"))  # fmt: skip
    check = by_name(checks(cfg))[name]
    assert check.status == status and fragment in check.detail and check.hint


def test_bad_configuration_fails_the_inventory_check(sockdir: Path) -> None:
    doc = {"flags": {"migStrategy": "single"}}
    cfg = make_config(
        sockdir / "device-plugins", sockdir / "state", doc, backend="sim", simProfile="a100-mig"
    )
    check = by_name(checks(cfg))["advertised devices"]
    assert check.status == FAIL and "single" in check.detail and check.hint


def test_cli_exit_status_and_json(sockdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "doctor",
        "--backend",
        "nvml",
        "--kubelet-dir",
        str(sockdir),
        "--state-dir",
        str(sockdir / "s"),
        "--json",
    ]
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML works on this machine: the nvml backend would not fail")
    except Exception:
        pass
    assert cli.main(args) == 1
    results = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert results["gpu backend"]["status"] == FAIL and "--backend sim" in results["gpu backend"]["hint"]
    assert results["python"]["status"] == OK
    assert (
        cli.main(
            ["doctor", "--backend", "sim", "--kubelet-dir", str(sockdir), "--state-dir", str(sockdir / "s")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[ ok ] gpu backend: sim:dgx-h100" in out
