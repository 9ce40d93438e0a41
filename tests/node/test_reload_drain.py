"""A live reload never changes how a GPU with live holders is sold: it waits until they are gone.

The attack: fractional on all 8 GPUs of the simulated dgx-h100, tenants' capped
regions on GPUs 1-7, then `fractional.devices: [0]` and SIGHUP. Re-advertising
GPUs 1-7 as nvidia.com/gpu at once would let a whole-GPU pod land on a GPU that
tenants share. They must stay gpu-memory units (as the kubelet's ListAndWatch
sees them) until their holders are gone, then switch; the reload says so per GPU
in the log, in a gauge, and in `gpunode devices` / `gpunode doctor`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpunode import cli
from gpunode.node import doctor
from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.kubelet.podresources import ContainerDevices
from gpunode.node.status import pending_lines
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn
from tests.fakes.podresources import PodResourcesStandIn

MEM = "gpunode.io/gpu-memory"
GPU = "nvidia.com/gpu"


def poll(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def served(kubelet: KubeletStandIn, resource: str) -> list[str]:
    return kubelet.healthy(resource) if resource in kubelet.plugins else []


def on_gpu(ids: list[str], uuid: str) -> list[str]:
    return sorted((i for i in ids if i.startswith(uuid + "::")), key=lambda i: int(i.rsplit("mem", 1)[1]))


def pending_series(ra: RunningAgent) -> list[dict[str, str]]:
    text = ra.agent.metrics.render().decode()
    return [
        s.labels
        for fam in text_string_to_metric_families(text)
        if fam.name == "gpunode_sharing_change_pending"
        for s in fam.samples
    ]


def test_reload_keeps_held_gpus_until_their_holders_are_gone(
    sockdir: Path,
    kubelet: KubeletStandIn,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def doc(devices: Any) -> dict[str, Any]:
        return {
            "gpunode": {
                "fractional": {"devices": devices, "unit": "1Gi"},
                "podResourcesSocket": str(sockdir / "pr.sock"),
            }
        }

    wanted = {"doc": doc("all")}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])
    backend = SimBackend.from_profile("dgx-h100")
    loader = lambda: make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])  # noqa: E731
    agent = Agent(cfg, backend=backend, config_loader=loader)
    gpus = backend.gpus()
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr, RunningAgent(agent) as ra:
        kubelet.wait_for_resources([MEM])
        ra.agent.gate.interval_s = 0.1
        assert ra.agent.plugins is not None
        ra.agent.plugins.holds.record_grace_s = 0.0
        every = served(kubelet, MEM)
        assert len(every) == 8 * 79 and GPU not in kubelet.plugins
        holders = []
        for g in gpus[1:]:
            ids = on_gpu(every, g.uuid)[: g.index * 3]
            kubelet.allocate(MEM, ids)
            holders.append(ContainerDevices("team", f"job-{g.index}", "main", MEM, tuple(ids)))
        pr.set_pods(holders)

        caplog.set_level(logging.INFO)
        wanted["doc"] = doc([0])
        ra.agent.request_reload()
        poll(lambda: len(ra.agent.gate.pending) == 7, "7 GPUs held back")
        time.sleep(0.5)  # several drain checks, the holders still there
        assert served(kubelet, MEM) == every, "GPUs 1-7 are still sold as memory units"
        assert GPU not in kubelet.plugins or not served(kubelet, GPU), "no GPU is sold whole while shared"
        held_lines = [r.getMessage() for r in caplog.records if "stays fractional" in r.getMessage()]
        assert len(held_lines) == 7, held_lines
        assert "GPU 3 (" in held_lines[2] and "team/job-3/main" in held_lines[2] and "whole" in held_lines[2]
        series = pending_series(ra)
        assert sorted(int(s["gpu"]) for s in series) == [1, 2, 3, 4, 5, 6, 7]
        assert all(s["current"] == "fractional" and s["wanted"] == "whole" for s in series)
        lines = pending_lines(sockdir / "state")
        assert len(lines) == 7 and "team/job-1/main" in lines[0]
        check = next(c for c in doctor.checks(ra.agent.config) if c.name == "sharing changes")
        assert check.status == doctor.WARN and "7 GPU(s) keep their old mode" in check.detail
        args = [
            "devices",
            "--backend",
            "sim",
            "--sim-profile",
            "dgx-h100",
            "--state-dir",
            str(sockdir / "state"),
        ]
        assert cli.main(args) == 0
        err = capsys.readouterr().err
        assert (
            err.count("pending: GPU ") == 7 and "stays fractional (" in err and "then becomes whole (" in err
        )
        assert cli.main([*args, "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["pending"]) == 7

        pr.set_pods(holders[3:])  # the jobs on GPUs 1-3 end
        # Each resource has its own ListAndWatch stream: wait for both updates, not the first.
        kubelet.wait_for(
            lambda: len(served(kubelet, GPU)) == 3 and len(served(kubelet, MEM)) == 5 * 79,
            what="GPUs 1-3 sold whole and their units withdrawn",
        )
        assert sorted(served(kubelet, GPU)) == sorted(g.uuid for g in gpus[1:4])
        pr.set_pods([])  # and the rest
        kubelet.wait_for(
            lambda: len(served(kubelet, GPU)) == 7 and len(served(kubelet, MEM)) == 79,
            what="the whole switch",
        )
        poll(lambda: not ra.agent.gate.pending, "nothing pending")
        assert pending_series(ra) == [] and pending_lines(sockdir / "state") == []
        assert any("its holders are gone; now whole" in r.getMessage() for r in caplog.records)


def test_without_the_kubelets_list_the_checkpoint_holds_a_gpu(sockdir: Path, kubelet: KubeletStandIn) -> None:
    def doc(devices: Any) -> dict[str, Any]:
        return {
            "gpunode": {
                "fractional": {"devices": devices, "unit": "1Gi"},
                "podResourcesSocket": str(sockdir / "absent.sock"),
            }
        }

    wanted = {"doc": doc([0, 1, 2])}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])
    backend = SimBackend.from_profile("t4")
    loader = lambda: make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])  # noqa: E731
    with RunningAgent(Agent(cfg, backend=backend, config_loader=loader)) as ra:
        kubelet.wait_for_resources([MEM, GPU])
        g1 = backend.gpus()[1].uuid
        kubelet.allocate(MEM, on_gpu(served(kubelet, MEM), g1)[:2])
        wanted["doc"] = doc([0])
        ra.agent.request_reload()
        poll(lambda: len(ra.agent.gate.pending) == 1, "GPU 1 held back")
        kubelet.wait_for(
            lambda: len(served(kubelet, GPU)) == 2 and len(served(kubelet, MEM)) == 2 * 15,
            what="GPU 2 sold whole and its units withdrawn",
        )
        assert g1 not in served(kubelet, GPU) and on_gpu(served(kubelet, MEM), g1)
        assert "memory-cap region" in " ".join(ra.agent.gate.pending[g1].holders)


def test_time_slicing_replicas_wait_for_their_holders(sockdir: Path, kubelet: KubeletStandIn) -> None:
    def doc(replicas: int) -> dict[str, Any]:
        return {
            "sharing": {
                "timeSlicing": {"renameByDefault": True, "resources": [{"name": GPU, "replicas": replicas}]}
            },
            "gpunode": {"podResourcesSocket": str(sockdir / "pr.sock")},
        }

    wanted = {"doc": doc(4)}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])
    backend = SimBackend.from_profile("t4")
    loader = lambda: make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])  # noqa: E731
    with (
        PodResourcesStandIn(str(sockdir / "pr.sock")) as pr,
        RunningAgent(Agent(cfg, backend=backend, config_loader=loader)) as ra,
    ):
        kubelet.wait_for_resources(["nvidia.com/gpu.shared"])
        ra.agent.gate.interval_s = 0.1
        assert ra.agent.plugins is not None
        ra.agent.plugins.holds.record_grace_s = 0.0
        g0 = backend.gpus()[0].uuid
        kubelet.allocate("nvidia.com/gpu.shared", [f"{g0}::2"])
        pr.set_pods([ContainerDevices("team", "a", "main", "nvidia.com/gpu.shared", (f"{g0}::2",))])
        wanted["doc"] = doc(2)
        ra.agent.request_reload()
        kubelet.wait_for(
            lambda: len(served(kubelet, "nvidia.com/gpu.shared")) == 4 + 3 * 2, what="GPUs 1-3 at 2"
        )
        assert [i for i in served(kubelet, "nvidia.com/gpu.shared") if i.startswith(g0)] == [
            f"{g0}::{n}" for n in range(4)
        ]
        pr.set_pods([])
        kubelet.wait_for(
            lambda: len(served(kubelet, "nvidia.com/gpu.shared")) == 8, what="GPU 0 at 2 as well"
        )


def test_a_held_mig_layout_waits_for_its_holders(sockdir: Path, kubelet: KubeletStandIn) -> None:
    """migStrategy mixed -> none would sell GPU 4 whole while a pod holds one of its MIG devices."""

    def doc(strategy: str) -> dict[str, Any]:
        return {
            "flags": {"migStrategy": strategy},
            "gpunode": {"podResourcesSocket": str(sockdir / "pr.sock")},
        }

    wanted = {"doc": doc("mixed")}
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])
    backend = SimBackend.from_profile("a100-mig")
    loader = lambda: make_config(sockdir / "device-plugins", sockdir / "state", wanted["doc"])  # noqa: E731
    with (
        PodResourcesStandIn(str(sockdir / "pr.sock")) as pr,
        RunningAgent(Agent(cfg, backend=backend, config_loader=loader)) as ra,
    ):
        kubelet.wait_for_resources(["nvidia.com/mig-3g.40gb"])
        ra.agent.gate.interval_s = 0.1
        assert ra.agent.plugins is not None
        ra.agent.plugins.holds.record_grace_s = 0.0
        gpu4 = backend.gpus()[4]
        mig = gpu4.mig_devices[0].uuid
        kubelet.allocate("nvidia.com/mig-3g.40gb", [mig])
        pr.set_pods([ContainerDevices("team", "a", "main", "nvidia.com/mig-3g.40gb", (mig,))])
        wanted["doc"] = doc("none")
        ra.agent.request_reload()
        kubelet.wait_for(lambda: len(served(kubelet, GPU)) == 7, what="the other GPUs sold whole")
        assert gpu4.uuid not in served(kubelet, GPU)
        kubelet.wait_for(
            lambda: (
                sorted(served(kubelet, "nvidia.com/mig-3g.40gb")) == sorted(m.uuid for m in gpu4.mig_devices)
            ),
            what="GPU 4's MIG devices alone still sold",
        )
        assert ra.agent.gate.pending[gpu4.uuid].holders == ("team/a/main",)
        pr.set_pods([])
        kubelet.wait_for(lambda: len(served(kubelet, GPU)) == 8, what="GPU 4 sold whole once free")


def test_a_restart_with_a_new_configuration_waits_for_holders_too(
    sockdir: Path, kubelet: KubeletStandIn
) -> None:
    """The chart rolls the agents when the configuration changes: a restart must not re-sell a held GPU either."""

    def cfg(devices: Any) -> Any:
        doc = {
            "gpunode": {
                "fractional": {"devices": devices, "unit": "1Gi"},
                "podResourcesSocket": str(sockdir / "pr.sock"),
            }
        }
        return make_config(sockdir / "device-plugins", sockdir / "state", doc)

    backend = SimBackend.from_profile("t4")
    g1 = backend.gpus()[1].uuid
    with PodResourcesStandIn(str(sockdir / "pr.sock")) as pr:
        with RunningAgent(Agent(cfg([0, 1]), backend=backend)) as ra:
            kubelet.wait_for_resources([MEM])
            ids = on_gpu(served(kubelet, MEM), g1)[:3]
            kubelet.allocate(MEM, ids)
        pr.set_pods([ContainerDevices("team", "a", "main", MEM, tuple(ids))])
        registered = len(kubelet.registrations)
        with RunningAgent(Agent(cfg([0]), backend=backend)) as ra:
            ra.agent.gate.interval_s = 0.1
            kubelet.wait_for(
                lambda: len(kubelet.registrations) >= registered + 2, what="the new agent registered"
            )
            kubelet.wait_for_resources([MEM, GPU])
            kubelet.wait_for(
                lambda: len(served(kubelet, MEM)) == 2 * 15 and len(served(kubelet, GPU)) == 2,
                what="GPU 1 still sold as units after the restart",
            )
            assert g1 not in served(kubelet, GPU) and list(ra.agent.gate.pending) == [g1]
            pr.set_pods([])
            kubelet.wait_for(
                lambda: len(served(kubelet, GPU)) == 3, timeout=20, what="GPU 1 sold whole once free"
            )
            # Each resource has its own ListAndWatch stream: the units' update may arrive just after.
            kubelet.wait_for(lambda: len(served(kubelet, MEM)) == 15, what="GPU 1's units withdrawn")
