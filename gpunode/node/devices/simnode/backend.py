"""A simulated GPU node: the Backend protocol over a YAML profile, with fault injection.

SimBackend behaves like NvmlBackend on the node a profile describes (see
gpunode.node.devices.simnode.profile for the schema and the bundled profiles): the same
frozen snapshots, the same errors (GpuLostError for a lost GPU,
DeviceNotFound for an unknown one), None for what the modelled GPU cannot
report (no row remapping on a T4, no profiling fields where the model lacks
them, no utilisation on a MIG-enabled GPU, as NVML answers). UUIDs are
deterministic: uuid5 of the profile name, its seed and the GPU index.

Telemetry comes from simgpu.SimGpu: a deterministic function of the clock and
of the simulated processes (memory used is the sum of their memory).

Faults (thread safe, for tests and for the control socket in simctl.py): XID
and ECC events, a lost GPU (listed, but unreadable, as NVML does), hot-remove
and hot-add, a GPU reset, row-remap and retired-page states, and a hanging
probe. Events reach `wait_event` in the order they were injected.

This module must not import NVML, and it never touches real devices.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gpunode.errors import DeviceNotFound, GpuLostError, GpunodeError, SimFaultError
from gpunode.node.devices.base import (
    DeviceEvent,
    EventKind,
    Gpu,
    GpuProbe,
    GpuProcess,
    GpuSample,
    ProcessUtilization,
)
from gpunode.node.devices.simnode.gpu import SimGpu
from gpunode.node.devices.simnode.profile import (
    SimProfile,
    bundled_profiles,
    load_profile,
)
from gpunode.node.devices.simnode.snapshot import (
    SimGpuState,
    created_mig,
    gpu_state,
    gpu_uuid,
    hotplug_slot,
    make_gpu,
    nvlink_peers,
)

__all__ = [
    "SimBackend",
    "SimFaultError",
    "SimGpuState",
    "SimProfile",
    "bundled_profiles",
    "load_profile",
]


class SimBackend:
    """The Backend protocol over a simulated node described by a SimProfile."""

    def __init__(
        self,
        profile: SimProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        probe_timeout_s: float = 5.0,
    ) -> None:
        self.profile = profile
        self.name = f"sim:{profile.name}"
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.RLock()
        self._events: queue.Queue[DeviceEvent] = queue.Queue()
        self._closed = threading.Event()
        self._added = 0
        self._created_migs = 0  # MIG instances created so far (each gets a new UUID, as NVML's)
        self._busy: dict[str, list[tuple[int, dict[int, int]]]] = {}  # uuid -> (wall us, busy ns by pid)
        now = clock()
        self._gpus: dict[str, SimGpu] = {}
        for spec in profile.gpus:
            uuid = gpu_uuid(profile, f"gpu/{spec.index}")
            model = profile.model(spec.model)
            gpu = make_gpu(spec.index, uuid, model, spec.pci_bus_id, spec.numa_node, spec.minor, spec.mig)
            self._gpus[uuid] = SimGpu(gpu, model, now)

    @classmethod
    def from_profile(
        cls,
        name_or_path: str | Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        probe_timeout_s: float = 5.0,
    ) -> SimBackend:
        """Load a bundled profile by name or a user's profile file and simulate it."""
        return cls(
            load_profile(name_or_path), clock=clock, wall_clock=wall_clock, probe_timeout_s=probe_timeout_s
        )

    # -- Backend protocol -------------------------------------------------------------------

    def driver_version(self) -> str | None:
        """The profile's driver_version."""
        return self.profile.driver_version

    def gpus(self) -> tuple[Gpu, ...]:
        """The simulated GPUs, ordered by index, with their NVLink peers; a lost GPU stays listed."""
        with self._lock:
            states = sorted(self._gpus.values(), key=lambda s: s.gpu.index)
            return tuple(replace(s.gpu, nvlink_peers=self._peers_of(s)) for s in states)

    def sample(self, uuid: str) -> GpuSample:
        """Telemetry of one GPU at the clock's time now; DeviceNotFound if unknown, GpuLostError if lost."""
        with self._lock:
            gs = self._readable(uuid)
            t = self._clock()
            self._advance(gs, t)
            return gs.sample(t, self._wall_clock())

    def processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        """The simulated processes on one GPU, by pid; DeviceNotFound if unknown, GpuLostError if lost."""
        with self._lock:
            gs = self._readable(uuid)
            return tuple(sorted(gs.processes.values(), key=lambda p: p.pid))

    def probe(self, uuid: str) -> GpuProbe:
        """Probe one GPU after its injected delay; reachable=False when the delay reaches probe_timeout_s.

        Raises DeviceNotFound for an unknown UUID.
        """
        started = time.monotonic()
        with self._lock:
            gs = self._present(uuid)
            delay = gs.probe_delay_s
        if delay > 0:
            if delay >= self.probe_timeout_s:
                self._closed.wait(self.probe_timeout_s)
                return GpuProbe(
                    uuid=uuid,
                    reachable=False,
                    detail=f"no answer within {self.probe_timeout_s:g} s: the driver call hangs",
                    duration_s=time.monotonic() - started,
                )
            self._closed.wait(delay)
        with self._lock:
            gs = self._present(uuid)
            self._advance(gs, self._clock())  # the energy count the probe reads is current
            return gs.probe_result(time.monotonic() - started)

    def wait_event(self, timeout_s: float) -> DeviceEvent | None:
        """The next injected event, in order, waiting up to timeout_s; None on timeout or once closed."""
        if self._closed.is_set():
            return None
        try:
            if timeout_s <= 0:
                return self._events.get_nowait()
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Close the node: a probe waiting out its delay returns at once and wait_event answers None."""
        self._closed.set()

    # -- MIG partitioning (MigPartitioner) --------------------------------------------------------

    def create_mig(self, gpu_uuid: str, profile: str, start: int) -> str:
        """Create a MIG instance of `profile` at memory slice `start` on a GPU in MIG mode; its UUID.

        The placement must be one of the profile's and free (no instance on its memory slices, enough
        compute slices left), as NVML requires; SimFaultError names why it is not."""
        with self._lock:
            gs = self._readable(gpu_uuid)
            if not gs.gpu.mig_enabled or gs.model.mig_table is None:
                raise SimFaultError(
                    f"GPU {gpu_uuid} is not in MIG mode; no MIG instance can be created on it"
                )
            self._created_migs += 1
            mig = created_mig(gs.gpu, gs.model.mig_table, profile, start, self._created_migs)
            gs.gpu = replace(gs.gpu, mig_devices=(*gs.gpu.mig_devices, mig))
            return mig.uuid

    def destroy_mig(self, mig_uuid: str) -> None:
        """Destroy a MIG instance; refused while a simulated process runs on it (NVML: in use)."""
        with self._lock:
            for gs in self._gpus.values():
                mig = gs.gpu.mig_by_uuid(mig_uuid)
                if mig is None:
                    continue
                if gs.lost:
                    raise GpuLostError(gs.gpu.uuid)
                users = sorted(p.pid for p in gs.processes.values() if p.mig_uuid == mig_uuid)
                if users:
                    raise SimFaultError(
                        f"MIG device {mig_uuid} is in use by process(es) {', '.join(map(str, users))}"
                    )
                gs.gpu = replace(
                    gs.gpu, mig_devices=tuple(m for m in gs.gpu.mig_devices if m.uuid != mig_uuid)
                )
                return
            raise DeviceNotFound(f"no MIG device {mig_uuid} on simulated node {self.profile.name}")

    # -- per-process utilisation (the driver's view of who used the GPU) -------------------------

    def report_process_busy(self, gpu_uuid: str, busy_ns: dict[int, int]) -> None:
        """The device time (ns, cumulative) each process has received on a GPU so far: the fake device's
        ground truth, from which process_utilization answers as NVML does. Pids reported here have a
        context on the GPU (processes() lists them) until a report leaves them out."""
        with self._lock:
            gs = self._readable(gpu_uuid)
            now_us = int(self._wall_clock() * 1e6)
            history = self._busy.setdefault(gpu_uuid, [])
            history.append((now_us, dict(busy_ns)))
            del history[:-64]  # NVML keeps a short buffer of samples too
            for pid in busy_ns:
                if pid > 0 and pid not in gs.processes:
                    gs.processes[pid] = GpuProcess(pid=pid, gpu_uuid=gpu_uuid, used_memory_bytes=0)
            for pid in [p for p, proc in gs.processes.items() if proc.used_memory_bytes == 0]:
                if pid not in busy_ns:
                    del gs.processes[pid]

    def process_utilization(self, uuid: str, since_us: int) -> tuple[ProcessUtilization, ...]:
        """Per-process SM utilisation samples taken after since_us (nvmlDeviceGetProcessUtilization): one
        per reported period, the share of the period's wall time the process's work got on the device."""
        with self._lock:
            self._readable(uuid)
            history = self._busy.get(uuid, [])
            out: list[ProcessUtilization] = []
            for (t0, b0), (t1, b1) in itertools.pairwise(history):
                if t1 <= since_us or t1 <= t0:
                    continue
                for pid, busy in b1.items():
                    got = max(0, busy - b0.get(pid, 0)) / ((t1 - t0) * 1e3)
                    out.append(ProcessUtilization(pid, t1, min(100, round(got * 100))))
            return tuple(out)

    # -- simulated processes ------------------------------------------------------------------

    def add_process(
        self, gpu_uuid: str, pid: int, used_bytes: int, mig_uuid: str | None = None
    ) -> GpuProcess:
        """Start a simulated process holding used_bytes of memory on a GPU (or one of its MIG devices)."""
        with self._lock:
            gs = self._readable(gpu_uuid)
            if pid <= 0 or used_bytes < 0:
                raise SimFaultError(
                    f"a process needs a positive pid and a non-negative size, got {pid}, {used_bytes}"
                )
            if pid in gs.processes:
                raise SimFaultError(f"process {pid} already runs on GPU {gpu_uuid}")
            if gs.gpu.mig_enabled and mig_uuid is None:
                raise SimFaultError(
                    f"GPU {gpu_uuid} is in MIG mode: a process must run on one of its MIG devices",
                    hint="pass mig_uuid (see Gpu.mig_devices)",
                )
            if not gs.gpu.mig_enabled and mig_uuid is not None:
                raise SimFaultError(f"GPU {gpu_uuid} is not in MIG mode; {mig_uuid} cannot be on it")
            if mig_uuid is not None and gs.gpu.mig_by_uuid(mig_uuid) is None:
                raise DeviceNotFound(f"MIG device {mig_uuid} is not on GPU {gpu_uuid}")
            in_use = gs.memory_used_bytes(mig_uuid)
            capacity = gs.memory_capacity_bytes(mig_uuid)
            if in_use + used_bytes > capacity:
                raise SimFaultError(
                    f"out of memory on {mig_uuid or gpu_uuid}: {in_use + used_bytes} bytes asked, "
                    f"{capacity} available",
                    hint="remove processes first or ask for less memory",
                )
            self._advance(gs, self._clock())
            process = GpuProcess(pid=pid, gpu_uuid=gpu_uuid, used_memory_bytes=used_bytes, mig_uuid=mig_uuid)
            gs.processes[pid] = process
            return process

    def remove_process(self, pid: int) -> None:
        """End a simulated process, on every GPU it used."""
        with self._lock:
            holders = [gs for gs in self._gpus.values() if pid in gs.processes]
            if not holders:
                raise SimFaultError(f"no simulated process with pid {pid}")
            now = self._clock()
            for gs in holders:
                self._advance(gs, now)
                del gs.processes[pid]

    def set_activity(self, gpu_uuid: str, ratio: float | None) -> None:
        """Pin a GPU's activity to a ratio in 0..1, or None to follow its processes again."""
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise SimFaultError(f"activity must be a ratio in 0..1, got {ratio}")
        with self._lock:
            gs = self._present(gpu_uuid)
            self._advance(gs, self._clock())
            gs.activity_override = ratio

    # -- fault injection -----------------------------------------------------------------------

    def inject_xid(self, gpu_uuid: str, code: int, mig_uuid: str | None = None) -> DeviceEvent:
        """Report an XID error on a GPU (or on one of its MIG devices)."""
        if isinstance(code, bool) or not isinstance(code, int) or code <= 0:
            raise SimFaultError(f"an XID is a positive integer, got {code!r}")
        with self._lock:
            gs = self._present(gpu_uuid)
            if mig_uuid is not None and gs.gpu.mig_by_uuid(mig_uuid) is None:
                raise DeviceNotFound(f"MIG device {mig_uuid} is not on GPU {gpu_uuid}")
            return self._emit(EventKind.XID, gpu_uuid, mig_uuid=mig_uuid, xid=code)

    def inject_ecc(self, gpu_uuid: str, double_bit: bool, count: int = 1) -> DeviceEvent:
        """Report count single-bit (corrected) or double-bit (uncorrected) ECC errors."""
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise SimFaultError(f"an ECC error count is a positive integer, got {count!r}")
        with self._lock:
            gs = self._present(gpu_uuid)
            if not gs.model.supports("ecc"):
                raise SimFaultError(f"GPU {gpu_uuid} ({gs.model.name}) has no ECC in this profile")
            if double_bit:
                gs.ecc_dbe += count
            else:
                gs.ecc_sbe += count
            kind = EventKind.ECC_DBE if double_bit else EventKind.ECC_SBE
            return self._emit(kind, gpu_uuid, count=count)

    def lose_gpu(self, gpu_uuid: str) -> DeviceEvent:
        """The GPU falls off the bus: still listed, but unreadable until reset_gpu."""
        with self._lock:
            gs = self._present(gpu_uuid)
            self._advance(gs, self._clock())
            gs.lost = True
            return self._emit(EventKind.GPU_LOST, gpu_uuid)

    def remove_gpu(self, gpu_uuid: str) -> DeviceEvent:
        """Hot-unplug: the GPU and its processes disappear."""
        with self._lock:
            self._present(gpu_uuid)
            del self._gpus[gpu_uuid]
            return self._emit(EventKind.GPU_REMOVED, gpu_uuid)

    def add_gpu(self, index: int | None = None, model: str | None = None) -> Gpu:
        """Hot-plug a new GPU (new UUID) into a free index; a profile slot keeps its bus ID and MIG layout."""
        with self._lock:
            used = {s.gpu.index for s in self._gpus.values()}
            if index is None:
                index = next(i for i in range(len(used) + 1) if i not in used)
            elif isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise SimFaultError(f"a GPU index is a non-negative integer, got {index!r}")
            elif index in used:
                raise SimFaultError(f"GPU index {index} is taken; remove that GPU first or pick a free index")
            try:
                sim_model = self.profile.model(model) if model is not None else None
            except GpunodeError as e:
                raise SimFaultError(str(e)) from None
            sim_model, bus, numa, minor, mig = hotplug_slot(
                self.profile, index, sim_model, self._gpus.values()
            )
            self._added += 1
            uuid = gpu_uuid(self.profile, f"added/{self._added}")
            gpu = make_gpu(index, uuid, sim_model, bus, numa, minor, mig)
            self._gpus[uuid] = SimGpu(gpu, sim_model, self._clock())
            self._emit(EventKind.GPU_ADDED, uuid)
            return replace(gpu, nvlink_peers=self._peers_of(self._gpus[uuid]))

    def reset_gpu(self, gpu_uuid: str) -> None:
        """Reset a GPU (see SimGpu.reset): it answers again, volatile ECC counts and pending remaps clear."""
        with self._lock:
            gs = self._present(gpu_uuid)
            self._advance(gs, self._clock())
            gs.reset()

    def set_row_remap(
        self,
        gpu_uuid: str,
        *,
        pending: bool | None = None,
        failure: bool | None = None,
        correctable: int | None = None,
        uncorrectable: int | None = None,
    ) -> None:
        """Set the row-remapper state that sample() and probe() report (A100 and later)."""
        with self._lock:
            gs = self._present(gpu_uuid)
            if not gs.model.supports("row_remapping"):
                raise SimFaultError(f"GPU {gpu_uuid} ({gs.model.name}) has no row remapping")
            for value in (correctable, uncorrectable):
                if value is not None and value < 0:
                    raise SimFaultError(f"a remapped-row count cannot be negative, got {value}")
            if pending is not None:
                gs.remap_pending = pending
            if failure is not None:
                gs.remap_failure = failure
            if correctable is not None:
                gs.remap_correctable = correctable
            if uncorrectable is not None:
                gs.remap_uncorrectable = uncorrectable

    def set_retired_pages_pending(self, gpu_uuid: str, pending: bool) -> None:
        """Set whether retired pages wait for a reset (GPUs with page retirement, before A100)."""
        with self._lock:
            gs = self._present(gpu_uuid)
            if not gs.model.supports("page_retirement"):
                raise SimFaultError(
                    f"GPU {gpu_uuid} ({gs.model.name}) has no page retirement (it remaps rows instead)"
                )
            gs.retired_pages_pending = pending

    def set_probe_delay(self, gpu_uuid: str, seconds: float) -> None:
        """Make probe() of this GPU take this long, as a hanging driver call would (0 to stop)."""
        if seconds < 0:
            raise SimFaultError(f"a probe delay cannot be negative, got {seconds}")
        with self._lock:
            self._present(gpu_uuid).probe_delay_s = float(seconds)

    # -- lookup helpers for the control socket --------------------------------------------------

    def resolve_gpu(self, ref: str | int) -> str:
        """The UUID of a GPU named by UUID, by index (int) or by an index written as digits."""
        with self._lock:
            if isinstance(ref, int) and not isinstance(ref, bool):
                index: int | None = ref
            elif isinstance(ref, str) and ref.strip().isdigit():
                index = int(ref)
            elif isinstance(ref, str):
                self._present(ref)
                return ref
            else:
                raise SimFaultError(f"a GPU is named by its UUID or its index, got {ref!r}")
            for gs in self._gpus.values():
                if gs.gpu.index == index:
                    return gs.gpu.uuid
            raise DeviceNotFound(f"no GPU with index {index} on simulated node {self.profile.name}")

    def gpu_states(self) -> tuple[SimGpuState, ...]:
        """Every present GPU with its fault state, by index."""
        with self._lock:
            return tuple(gpu_state(gpu, self._gpus[gpu.uuid]) for gpu in self.gpus())

    # -- internals --------------------------------------------------------------------------------

    def _advance(self, gs: SimGpu, t: float) -> None:
        gs.advance(t, linked=bool(self._peers_of(gs)))

    def _present(self, uuid: str) -> SimGpu:
        gs = self._gpus.get(uuid)
        if gs is None:
            raise DeviceNotFound(f"no GPU {uuid} on simulated node {self.profile.name}")
        return gs

    def _readable(self, uuid: str) -> SimGpu:
        gs = self._present(uuid)
        if gs.lost:
            raise GpuLostError(uuid)
        return gs

    def _peers_of(self, gs: SimGpu) -> tuple[str, ...]:
        return nvlink_peers(self.profile, gs, self._gpus.values())

    def _emit(
        self,
        kind: EventKind,
        gpu_uuid: str,
        *,
        mig_uuid: str | None = None,
        xid: int | None = None,
        count: int = 1,
    ) -> DeviceEvent:
        event = DeviceEvent(
            kind=kind,
            gpu_uuid=gpu_uuid,
            mig_uuid=mig_uuid,
            xid=xid,
            count=count,
            timestamp=self._wall_clock(),
        )
        self._events.put(event)
        return event
