"""Remediation without Kubernetes: stop the processes on a failed GPU, or hand the fault to a hook command.

For each new Fault, BareMetalRemediator asks the backend which processes have
a context on the GPU (or on the failed MIG instance only), sends each SIGTERM,
waits the grace period, and sends SIGKILL to those still alive. Processes are
addressed through pidfds (Linux 5.3+), so a PID reused by an unrelated process
during the grace period is never signalled. With a hook configured, the hook
runs instead of the signals, with the fault in its environment (GPUNODE_GPU_UUID,
GPUNODE_MIG_UUID, GPUNODE_FAULT, GPUNODE_XID, GPUNODE_REASON, GPUNODE_PIDS,
GPUNODE_DEVICE_IDS), for instance to drain the node in Slurm. Every step is a
structured record in the journal (one JSON log line each); dry-run only
records. The agent's own process is never signalled, and a process is
signalled for at most one fault.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpunode.config.health import RemediationConfig
from gpunode.errors import GpunodeError
from gpunode.node.devices.base import Backend, GpuProcess
from gpunode.node.health.actions import ActionRecord, Journal, Memory, fault_fields
from gpunode.node.health.model import Fault

log = logging.getLogger("gpunode.node.health")

KILL_WAIT_S = 2.0  # how long to wait for a SIGKILLed process to be gone before reporting it


@dataclass
class _Target:
    pid: int
    key: tuple[int, str]  # (pid, start time): one process, even if its PID is reused later
    fd: int | None  # pidfd, None where the kernel has none


def _start_time(pid: int) -> str | None:
    """The process start time from /proc/<pid>/stat (field 22), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive_without_pidfd(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _exited(target: _Target) -> bool:
    if target.fd is None:
        return not _alive_without_pidfd(target.pid)
    poller = select.poll()
    poller.register(target.fd, select.POLLIN)
    return bool(poller.poll(0))


def _wait_exit(targets: Sequence[_Target], timeout_s: float) -> list[_Target]:
    """Wait until every target exited or the timeout passed; return those still running."""
    deadline = time.monotonic() + timeout_s
    alive = [t for t in targets if not _exited(t)]
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with_fd = [t for t in alive if t.fd is not None]
        if with_fd and len(with_fd) == len(alive):
            poller = select.poll()
            for t in with_fd:
                assert t.fd is not None
                poller.register(t.fd, select.POLLIN)
            poller.poll(int(left * 1000) + 1)
        else:
            time.sleep(min(0.02, left))
        alive = [t for t in alive if not _exited(t)]
    return alive


def _send(target: _Target, sig: signal.Signals) -> None:
    if target.fd is not None:
        signal.pidfd_send_signal(target.fd, sig)
    else:
        os.kill(target.pid, sig)


class BareMetalRemediator:
    """Signals (or hands to a hook) the processes on failed GPUs. See the module docstring."""

    def __init__(
        self, config: RemediationConfig, *, backend: Backend, journal: Journal | None = None
    ) -> None:
        self.config = config
        self.backend = backend
        self.journal = journal or Journal()
        self._lock = threading.Lock()
        self._pending: deque[Fault] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._signalled = Memory()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def notify(self, unhealthy: Mapping[str, str], faults: Sequence[Fault]) -> None:
        """Queue new faults for run() to remediate and wake it; thread safe. `unhealthy` is not used here."""
        if not faults:
            return
        with self._lock:
            self._pending.extend(faults)
            loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Remediate queued faults in worker threads until cancelled; sets `ready` once it takes faults."""
        wake = asyncio.Event()
        with self._lock:
            self._loop, self._wake = asyncio.get_running_loop(), wake
            wake.set()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="gpunode-baremetal"
        )
        tasks: set[asyncio.Future[None]] = set()
        if ready is not None:
            ready.set()
        try:
            while True:
                await wake.wait()
                wake.clear()
                with self._lock:
                    faults = list(self._pending)
                    self._pending.clear()
                for fault in faults:
                    fut = asyncio.get_running_loop().run_in_executor(self._executor, self.remediate, fault)
                    tasks.add(fut)
                    fut.add_done_callback(tasks.discard)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            with self._lock:
                self._loop = self._wake = None

    # -- one fault (blocking; runs in a worker thread) ---------------------------------------------

    def remediate(self, fault: Fault) -> None:
        """Stop the processes on the fault's GPU (or on its MIG device only); blocks; journals each step.

        With a hook configured the hook runs instead of the signals, even when the processes cannot be listed.
        """
        fields = fault_fields(fault)
        try:
            procs = self.backend.processes(fault.gpu_uuid)
        except GpunodeError as exc:
            self.journal.add(ActionRecord("lookup", "failed", detail=str(exc), **fields))
            procs = ()
            if self.config.baremetal.hook is None:
                return
        if fault.mig_uuid is not None:
            procs = tuple(p for p in procs if p.mig_uuid == fault.mig_uuid)
        procs = tuple(p for p in procs if p.pid != os.getpid())
        self.journal.add(
            ActionRecord("lookup", "done", detail=f"{len(procs)} process(es) on the device", **fields)
        )
        if self.config.baremetal.hook is not None:
            self._run_hook(fault, procs, fields)
        else:
            self._signal(procs, fields)

    def _run_hook(self, fault: Fault, procs: Sequence[GpuProcess], fields: dict[str, Any]) -> None:
        hook = self.config.baremetal.hook
        assert hook is not None
        env = {
            **os.environ,
            "GPUNODE_GPU_UUID": fault.gpu_uuid,
            "GPUNODE_MIG_UUID": fault.mig_uuid or "",
            "GPUNODE_FAULT": fault.kind,
            "GPUNODE_XID": "" if fault.xid is None else str(fault.xid),
            "GPUNODE_REASON": fault.reason,
            "GPUNODE_PIDS": " ".join(str(p.pid) for p in procs),
            "GPUNODE_DEVICE_IDS": " ".join(fault.device_ids),
        }
        if self.config.dry_run:
            self.journal.add(ActionRecord("hook", "dry-run", detail=" ".join(hook), dry_run=True, **fields))
            return
        timeout_s = self.config.baremetal.hook_timeout_s
        try:
            done = subprocess.run(
                list(hook),
                env=env,
                capture_output=True,
                timeout=timeout_s,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            self.journal.add(ActionRecord("hook", "failed", detail=f"killed after {timeout_s:g} s", **fields))
            return
        except OSError as exc:
            self.journal.add(
                ActionRecord("hook", "failed", detail=f"cannot run {hook[0]}: {exc.strerror}", **fields)
            )
            return
        output = (done.stdout + done.stderr).decode("utf-8", "replace").strip()[-300:]
        result = "done" if done.returncode == 0 else "failed"
        detail = f"exit status {done.returncode}" + (f": {output}" if output else "")
        self.journal.add(ActionRecord("hook", result, detail=detail, **fields))

    def _signal(self, procs: Sequence[GpuProcess], fields: dict[str, Any]) -> None:
        """SIGTERM the processes, then SIGKILL those still running after the grace period; journal each step."""
        targets = self._targets(procs, fields)
        try:
            self._terminate(targets, fields)
            self._kill_survivors(targets, fields)
        finally:
            for t in targets:
                if t.fd is not None:
                    os.close(t.fd)

    def _targets(self, procs: Sequence[GpuProcess], fields: dict[str, Any]) -> list[_Target]:
        """The processes to signal, each opened as a pidfd where the kernel has them.

        A process already gone, signalled for an earlier fault, or (dry run) only recorded is
        left out; every process taken is remembered, so no later fault signals it again.
        """
        targets: list[_Target] = []
        for p in procs:
            started = _start_time(p.pid)
            if started is None:
                self.journal.add(ActionRecord("sigterm", "gone", pid=p.pid, **fields))
                continue
            key = (p.pid, started)
            if key in self._signalled:
                self.journal.add(
                    ActionRecord(
                        "sigterm", "skipped", pid=p.pid, detail="signalled for an earlier fault", **fields
                    )
                )
                continue
            if self.config.dry_run:
                self.journal.add(ActionRecord("sigterm", "dry-run", pid=p.pid, dry_run=True, **fields))
                continue
            try:
                fd: int | None = os.pidfd_open(p.pid)
            except ProcessLookupError:
                self.journal.add(ActionRecord("sigterm", "gone", pid=p.pid, **fields))
                continue
            except (AttributeError, OSError):
                fd = None  # no pidfd on this kernel
            self._signalled.add(key)
            targets.append(_Target(p.pid, key, fd))
        return targets

    def _terminate(self, targets: list[_Target], fields: dict[str, Any]) -> None:
        """SIGTERM every target; one that is gone or may not be signalled is taken off the list."""
        for t in list(targets):
            try:
                _send(t, signal.SIGTERM)
            except ProcessLookupError:
                self.journal.add(ActionRecord("sigterm", "gone", pid=t.pid, **fields))
                targets.remove(t)
                continue
            except PermissionError as exc:
                self.journal.add(ActionRecord("sigterm", "failed", pid=t.pid, detail=str(exc), **fields))
                targets.remove(t)
                continue
            self.journal.add(ActionRecord("sigterm", "done", pid=t.pid, **fields))

    def _kill_survivors(self, targets: Sequence[_Target], fields: dict[str, Any]) -> None:
        """Wait the grace period, SIGKILL the targets still running, and report any that outlive SIGKILL."""
        grace = self.config.baremetal.term_grace_s
        survivors = _wait_exit(targets, grace)
        for t in targets:
            if t not in survivors:
                self.journal.add(
                    ActionRecord("exit", "done", pid=t.pid, detail="exited after SIGTERM", **fields)
                )
        for t in survivors:
            try:
                _send(t, signal.SIGKILL)
            except ProcessLookupError:
                self.journal.add(
                    ActionRecord("exit", "done", pid=t.pid, detail="exited after SIGTERM", **fields)
                )
                continue
            self.journal.add(
                ActionRecord(
                    "sigkill",
                    "done",
                    pid=t.pid,
                    detail=f"still running {grace:g} s after SIGTERM",
                    **fields,
                )
            )
        for t in _wait_exit(survivors, KILL_WAIT_S):
            self.journal.add(
                ActionRecord("sigkill", "failed", pid=t.pid, detail="still running after SIGKILL", **fields)
            )
