"""Bare-metal remediation against real child processes registered as GPU processes in the simulated node."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpunode.config.agent import parse_config
from gpunode.config.health import BareMetalConfig, HealthConfig, RemediationConfig
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.health.actions import ActionRecord
from gpunode.node.health.baremetal import BareMetalRemediator
from gpunode.node.health.model import Fault
from gpunode.node.health.monitor import HealthMonitor
from gpunode.node.inventory import build_inventory
from gpunode.node.state import DeviceState

CONFIG = RemediationConfig(mode="baremetal", baremetal=BareMetalConfig(term_grace_s=0.3))
HEALTH = HealthConfig(probe_interval_s=0.05, recovery_window_s=0.2)

# A process that reports SIGTERM and keeps running: only SIGKILL ends it.
STUBBORN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: print('got SIGTERM', flush=True))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


class Children:
    """Child processes of the test; all of them are reaped (or killed) at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def sleeper(self) -> subprocess.Popen[str]:
        p = subprocess.Popen(["sleep", "60"], text=True)
        self.procs.append(p)
        return p

    def stubborn(self) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        self.procs.append(p)
        return p

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def children() -> Iterator[Children]:
    c = Children()
    yield c
    c.cleanup()


def records(r: BareMetalRemediator, action: str, result: str | None = None) -> list[ActionRecord]:
    return [x for x in r.journal.records(action) if result is None or x.result == result]


def fault_on(backend: SimBackend, index: int, mig: int | None = None, xid: int = 79) -> Fault:
    gpu = backend.gpus()[index]
    mig_uuid = None if mig is None else gpu.mig_devices[mig].uuid
    return Fault(
        target_uuid=mig_uuid or gpu.uuid,
        gpu_uuid=gpu.uuid,
        mig_uuid=mig_uuid,
        kind="xid",
        reason=f"XID {xid}",
        xid=xid,
        device_ids=(mig_uuid or gpu.uuid,),
    )


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_sigterm_then_sigkill_only_on_the_failed_gpu(children: Children) -> None:
    """End to end: an XID on the simulated GPU -> HealthMonitor -> the remediator signals its processes."""
    backend = SimBackend.from_profile("dgx-h100")
    gpus = backend.gpus()
    polite, stubborn, bystander = children.sleeper(), children.stubborn(), children.sleeper()
    backend.add_process(gpus[3].uuid, polite.pid, 1 << 30)
    backend.add_process(gpus[3].uuid, stubborn.pid, 1 << 30)
    backend.add_process(gpus[4].uuid, bystander.pid, 1 << 30)
    remediator = BareMetalRemediator(CONFIG, backend=backend)
    state = DeviceState(build_inventory(gpus, parse_config({}, "t")))
    monitor = HealthMonitor(backend=backend, state=state, config=HEALTH, remediator=remediator)

    async def scenario() -> None:
        task = asyncio.create_task(remediator.run())
        backend.inject_xid(gpus[3].uuid, 79)
        event = await asyncio.to_thread(backend.wait_event, 5.0)
        assert event is not None
        monitor.handle_event(event)
        await asyncio.to_thread(wait_until, lambda: bool(records(remediator, "sigkill")), "the SIGKILL")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert polite.wait(5) == -signal.SIGTERM
    assert stubborn.wait(5) == -signal.SIGKILL
    assert stubborn.stdout is not None and stubborn.stdout.read() == "got SIGTERM\n"
    assert bystander.poll() is None  # another GPU's process is left alone
    sigterms = records(remediator, "sigterm", "done")
    assert {r.pid for r in sigterms} == {polite.pid, stubborn.pid}
    (sigkill,) = records(remediator, "sigkill", "done")
    assert sigkill.pid == stubborn.pid and sigkill.gpu_uuid == gpus[3].uuid and sigkill.xid == 79
    assert [r.pid for r in records(remediator, "exit", "done")] == [polite.pid]
    order = [r.action for r in remediator.journal.records() if r.pid == stubborn.pid]
    assert order == ["sigterm", "sigkill"]


def test_a_mig_fault_signals_only_that_instance(children: Children) -> None:
    backend = SimBackend.from_profile("a100-mig")
    gpu = backend.gpus()[2]
    on_failed, on_neighbour = children.sleeper(), children.sleeper()
    backend.add_process(gpu.uuid, on_failed.pid, 1 << 30, mig_uuid=gpu.mig_devices[0].uuid)
    backend.add_process(gpu.uuid, on_neighbour.pid, 1 << 30, mig_uuid=gpu.mig_devices[1].uuid)
    remediator = BareMetalRemediator(CONFIG, backend=backend)
    remediator.remediate(fault_on(backend, 2, mig=0, xid=94))
    assert on_failed.wait(5) == -signal.SIGTERM
    assert on_neighbour.poll() is None
    assert [r.pid for r in records(remediator, "sigterm", "done")] == [on_failed.pid]


def test_dry_run_signals_nothing(children: Children) -> None:
    backend = SimBackend.from_profile("t4")
    p = children.sleeper()
    backend.add_process(backend.gpus()[0].uuid, p.pid, 1 << 20)
    remediator = BareMetalRemediator(replace(CONFIG, dry_run=True), backend=backend)
    remediator.remediate(fault_on(backend, 0))
    assert p.poll() is None
    (r,) = records(remediator, "sigterm")
    assert (r.result, r.pid, r.dry_run) == ("dry-run", p.pid, True)


def test_a_process_is_signalled_for_one_fault_only(children: Children) -> None:
    backend = SimBackend.from_profile("t4")
    stubborn = children.stubborn()
    backend.add_process(backend.gpus()[1].uuid, stubborn.pid, 1 << 20)
    remediator = BareMetalRemediator(
        replace(CONFIG, baremetal=BareMetalConfig(term_grace_s=1.0)), backend=backend
    )
    first = threading.Thread(target=remediator.remediate, args=(fault_on(backend, 1),))
    first.start()
    wait_until(lambda: bool(records(remediator, "sigterm", "done")), "the first SIGTERM")
    remediator.remediate(fault_on(backend, 1))  # the GPU fails again during the grace period
    first.join()
    assert stubborn.wait(5) == -signal.SIGKILL
    assert [r.result for r in records(remediator, "sigterm")] == ["done", "skipped"]
    assert len(records(remediator, "sigkill", "done")) == 1
    remediator.remediate(fault_on(backend, 1))  # the sim still lists the pid, which is gone now
    assert [r.result for r in records(remediator, "sigterm")] == ["done", "skipped", "gone"]


def test_the_agent_never_signals_itself() -> None:
    backend = SimBackend.from_profile("t4")
    backend.add_process(backend.gpus()[0].uuid, os.getpid(), 1 << 20)
    remediator = BareMetalRemediator(CONFIG, backend=backend)
    remediator.remediate(fault_on(backend, 0))
    assert records(remediator, "sigterm") == []
    assert records(remediator, "lookup", "done")[0].detail == "0 process(es) on the device"


def hook_config(tmp_path: Path, script: str, timeout_s: float = 10.0) -> RemediationConfig:
    path = tmp_path / "hook.sh"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return replace(CONFIG, baremetal=BareMetalConfig(hook=(str(path), "--drain"), hook_timeout_s=timeout_s))


def test_hook_runs_instead_of_signals_with_the_fault_in_its_environment(
    children: Children, tmp_path: Path
) -> None:
    backend = SimBackend.from_profile("a100-mig")
    gpu = backend.gpus()[3]
    p = children.sleeper()
    backend.add_process(gpu.uuid, p.pid, 1 << 20, mig_uuid=gpu.mig_devices[1].uuid)
    out = tmp_path / "env.txt"
    config = hook_config(tmp_path, f'echo "$@" > {out}; env | grep ^GPUNODE_ | sort >> {out}; echo drained\n')
    remediator = BareMetalRemediator(config, backend=backend)
    remediator.remediate(fault_on(backend, 3, mig=1, xid=94))
    assert p.poll() is None  # the hook decides; no signal is sent
    lines = out.read_text().splitlines()
    assert lines[0] == "--drain"
    env = dict(line.split("=", 1) for line in lines[1:])
    assert env == {
        "GPUNODE_DEVICE_IDS": gpu.mig_devices[1].uuid,
        "GPUNODE_FAULT": "xid",
        "GPUNODE_GPU_UUID": gpu.uuid,
        "GPUNODE_MIG_UUID": gpu.mig_devices[1].uuid,
        "GPUNODE_PIDS": str(p.pid),
        "GPUNODE_REASON": "XID 94",
        "GPUNODE_XID": "94",
    }
    (r,) = records(remediator, "hook")
    assert (r.result, r.detail) == ("done", "exit status 0: drained")
    assert records(remediator, "sigterm") == []


@pytest.mark.parametrize(
    ("script", "timeout_s", "detail"),
    [
        pytest.param(
            "echo cannot drain >&2; exit 3\n", 10.0, "exit status 3: cannot drain", id="exit-status"
        ),
        pytest.param("sleep 30\n", 0.2, "killed after 0.2 s", id="timeout"),
    ],
)
def test_hook_failures_are_recorded(tmp_path: Path, script: str, timeout_s: float, detail: str) -> None:
    backend = SimBackend.from_profile("t4")
    remediator = BareMetalRemediator(hook_config(tmp_path, script, timeout_s), backend=backend)
    remediator.remediate(fault_on(backend, 0))
    (r,) = records(remediator, "hook")
    assert (r.result, r.detail) == ("failed", detail)


def test_a_lost_gpu_cannot_list_processes_but_the_hook_still_runs(tmp_path: Path) -> None:
    backend = SimBackend.from_profile("t4")
    backend.lose_gpu(backend.gpus()[2].uuid)
    out = tmp_path / "ran"
    remediator = BareMetalRemediator(hook_config(tmp_path, f"touch {out}\n"), backend=backend)
    remediator.remediate(fault_on(backend, 2))
    assert "is lost" in records(remediator, "lookup", "failed")[0].detail
    assert out.exists()
    plain = BareMetalRemediator(CONFIG, backend=backend)
    plain.remediate(fault_on(backend, 2))
    assert [r.result for r in plain.journal.records()] == ["failed"]


def test_each_action_is_one_json_log_line(children: Children, caplog: pytest.LogCaptureFixture) -> None:
    backend = SimBackend.from_profile("t4")
    p = children.sleeper()
    backend.add_process(backend.gpus()[0].uuid, p.pid, 1 << 20)
    remediator = BareMetalRemediator(CONFIG, backend=backend)
    with caplog.at_level(logging.INFO, logger="gpunode.remediation"):
        remediator.remediate(fault_on(backend, 0))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpunode.remediation"]
    assert [(x["action"], x["result"]) for x in lines] == [
        ("lookup", "done"),
        ("sigterm", "done"),
        ("exit", "done"),
    ]
    sigterm = lines[1]
    assert sigterm["event"] == "remediation" and sigterm["pid"] == p.pid and sigterm["xid"] == 79
    assert sigterm["gpu_uuid"] == backend.gpus()[0].uuid and sigterm["dry_run"] is False
    assert isinstance(sigterm["at"], float)
