"""The NVML backend: the Backend protocol over the NVIDIA driver's management library.

This is the only module that imports pynvml (from the nvidia-ml-py package);
every NVML call goes through the one query helper, nvmlquery.NvmlQuery, which
translates NVML's errors (not supported -> None, GPU lost -> GpuLostError,
library or driver missing -> BackendUnavailable, others -> BackendError).

Discovery reads, per GPU: index, UUID, name, memory total
(nvmlDeviceGetMemoryInfo), PCI bus ID, NUMA node (nvmlDeviceGetNumaNodeId,
else /sys/bus/pci/devices/<bdf>/numa_node), minor number (else
/proc/driver/nvidia/gpus/<bdf>/information), architecture, MIG mode and the
MIG devices (profile from the MIG device's name, "... MIG 1g.10gb", slices
from its attributes, GPU/compute instance IDs, memory), and NVLink peers:
for every active link, the remote end's type and PCI bus ID; a GPU at the far
end is a peer, and all GPUs with an active link to an NVSwitch form one mesh.
A GPU that is lost during discovery stays listed with its last known snapshot.

Telemetry (sample) lives in nvmlsample.py with its table of NVML calls per
field. Processes are read per MIG device on a MIG-enabled GPU (NVML gives the
aggregate on the parent only to privileged callers). probe() runs its calls
in a worker thread and answers reachable=False when NVML does not answer in
time. wait_event() waits on an NVML event set with XID and single/double-bit
ECC events registered on every GPU that supports them.

The NVML module is a constructor parameter, so tests run this code against a
fake module that behaves like pynvml.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpunode.contract.deviceids import normalize_pci_bus_id
from gpunode.errors import BackendError, BackendUnavailable, DeviceNotFound, GpuLostError
from gpunode.node.devices.base import (
    DeviceEvent,
    EventKind,
    Gpu,
    GpuProbe,
    GpuProcess,
    GpuSample,
    MigDevice,
    ProcessUtilization,
)
from gpunode.node.devices.nvml import partition
from gpunode.node.devices.nvml.discovery import (
    discover_mig,
    memory_total,
    minor_number,
    numa_node,
    nvlink_peers,
)
from gpunode.node.devices.nvml.query import (
    ERR_TIMEOUT,
    ERR_UNINITIALIZED,
    NvmlQuery,
)
from gpunode.node.devices.nvml.sample import GpmState, read_sample
from gpunode.node.devices.simnode.mig import table_of_model

log = logging.getLogger(__name__)

NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID_CRITICAL = 0x8
INVALID_INSTANCE_ID = 0xFFFFFFFF

_ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing",
    7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell",
}  # fmt: skip


def load_pynvml() -> Any:
    """Import pynvml (nvidia-ml-py), or raise BackendUnavailable when it is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        raise BackendUnavailable(
            "the nvidia-ml-py package (module pynvml) is not installed",
            hint="pip install nvidia-ml-py, or pass --backend sim to run on a simulated node",
        ) from None


class NvmlBackend:
    """The Backend protocol over NVML."""

    name = "nvml"

    def __init__(
        self,
        *,
        nvml: Any | None = None,
        probe_timeout_s: float = 5.0,
        sysfs_root: str | Path = "/sys",
        procfs_root: str | Path = "/proc",
    ) -> None:
        self._q = NvmlQuery(nvml if nvml is not None else load_pynvml())
        self.probe_timeout_s = probe_timeout_s
        self._sysfs = Path(sysfs_root)
        self._procfs = Path(procfs_root)
        self._lock = threading.Lock()  # guards the dictionaries below
        self._handles: dict[str, Any] = {}
        self._known: dict[int, Gpu] = {}  # last snapshot per index, to keep listing a lost GPU
        self._mig: dict[str, tuple[tuple[Any, MigDevice], ...]] = {}  # parent UUID -> MIG handles
        self._gpm = GpmState(self._q)
        self._event_lock = threading.Lock()
        self._event_set: Any = None
        self._registered: set[str] = set()
        self._hung: dict[str, threading.Thread] = {}
        self._closed = False
        self._q.init()
        self._driver = self._q.call("nvmlSystemGetDriverVersion")

    # -- Backend protocol -------------------------------------------------------------------

    def driver_version(self) -> str | None:
        """The driver version read at start (nvmlSystemGetDriverVersion); None when NVML did not give one."""
        return str(self._driver) if self._driver is not None else None

    def gpus(self) -> tuple[Gpu, ...]:
        """Discover the GPUs now, ordered by index, with their NVLink peers.

        A GPU lost since it was last seen stays listed with that snapshot; one never seen is left out.
        """
        count = int(self._q.require("nvmlDeviceGetCount"))
        found: list[tuple[Gpu, Any]] = []
        for index in range(count):
            with self._lock:
                known = self._known.get(index)
            try:
                found.append(self._discover(index, known.uuid if known else f"at index {index}"))
            except GpuLostError:
                if known is None:
                    log.warning(
                        "the GPU at NVML index %d is lost and was never seen; it is not listed", index
                    )
                    continue
                found.append((known, None))
        peers = nvlink_peers(self._q, found)
        order = {g.uuid: g.index for g, _ in found}
        gpus = tuple(
            g if h is None else replace(g, nvlink_peers=tuple(sorted(peers[g.uuid], key=order.__getitem__)))
            for g, h in found
        )
        with self._lock:
            # Forget GPUs that left the bus; a lost GPU keeps its old handle and snapshot.
            self._handles = {g.uuid: h or self._handles.get(g.uuid) for g, h in found}
            self._handles = {u: h for u, h in self._handles.items() if h is not None}
            self._known = {g.index: g for g in gpus}
            self._mig = {g.uuid: self._mig.get(g.uuid, ()) for g in gpus}
        self._gpm.retain({g.uuid for g in gpus})
        return gpus

    def sample(self, uuid: str) -> GpuSample:
        """Telemetry of one GPU and its MIG devices; DeviceNotFound if unknown, GpuLostError if lost."""
        handle = self._handle(uuid)
        with self._lock:
            migs = self._mig.get(uuid, ())
        return read_sample(self._q, handle, uuid, migs, self._gpm)

    def processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        """Processes with a compute or graphics context on the GPU (per MIG device in MIG mode), by pid."""
        handle = self._handle(uuid)
        with self._lock:
            migs = self._mig.get(uuid, ())
        sources = [(mh, m.uuid) for mh, m in migs] if migs else [(handle, None)]
        merged: dict[tuple[int, str | None], GpuProcess] = {}
        for h, mig_uuid in sources:
            for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                rows = self._q.call(fn, h, uuid=uuid)
                if rows is None:  # a driver without the v3 call: the v2 struct has the same fields
                    rows = self._q.call(f"{fn}_v2", h, uuid=uuid)
                for p in rows or ():
                    used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else None
                    key = (int(p.pid), mig_uuid)
                    old = merged.get(key)
                    if old is not None and old.used_memory_bytes is not None:
                        used = max(used or 0, old.used_memory_bytes)
                    merged[key] = GpuProcess(
                        pid=int(p.pid), gpu_uuid=uuid, used_memory_bytes=used, mig_uuid=mig_uuid
                    )
        return tuple(sorted(merged.values(), key=lambda p: (p.pid, p.mig_uuid or "")))

    def process_utilization(self, uuid: str, since_us: int) -> tuple[ProcessUtilization, ...]:
        """Per-process SM utilisation samples taken after since_us (nvmlDeviceGetProcessUtilization; NVML
        keeps a short buffer of them); empty when NVML has none or the GPU cannot report them."""
        handle = self._handle(uuid)
        # No sample since since_us: NVML says NOT_FOUND (absent), or nvidia-ml-py raises its error for SUCCESS (0).
        rows = self._q.call("nvmlDeviceGetProcessUtilization", handle, int(since_us), uuid=uuid, absent=(0,))
        return tuple(
            ProcessUtilization(int(r.pid), int(r.timeStamp), max(0, min(100, int(r.smUtil))))
            for r in rows or ()
            if int(r.pid) > 0
        )

    def probe(self, uuid: str) -> GpuProbe:
        """Probe one GPU in a worker thread, waiting at most probe_timeout_s.

        Answers reachable=False when NVML fails, reports the GPU lost, does not answer in time, or an earlier
        probe of the GPU still hangs. Raises DeviceNotFound for an unknown UUID.
        """
        started = time.monotonic()
        with self._lock:
            hung = self._hung.get(uuid)
        if hung is not None and hung.is_alive():
            return GpuProbe(
                uuid=uuid,
                reachable=False,
                detail="an earlier probe of this GPU is still waiting for NVML",
                duration_s=time.monotonic() - started,
            )
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["probe"] = self._probe_now(uuid)
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        worker = threading.Thread(target=work, name=f"nvml-probe-{uuid[4:12]}", daemon=True)
        worker.start()
        worker.join(self.probe_timeout_s)
        elapsed = time.monotonic() - started
        if worker.is_alive():
            with self._lock:
                self._hung[uuid] = worker
            return GpuProbe(
                uuid=uuid,
                reachable=False,
                detail=f"NVML did not answer within {self.probe_timeout_s:g} s",
                duration_s=elapsed,
            )
        error = box.get("error")
        if isinstance(error, DeviceNotFound):
            raise error
        if isinstance(error, GpuLostError):
            return GpuProbe(uuid=uuid, reachable=False, detail=str(error), duration_s=elapsed)
        if isinstance(error, BackendError):
            return GpuProbe(uuid=uuid, reachable=False, detail=f"probe failed: {error}", duration_s=elapsed)
        if error is not None:
            raise error
        return replace(box["probe"], duration_s=elapsed)

    def wait_event(self, timeout_s: float) -> DeviceEvent | None:
        """Wait up to timeout_s for an XID or ECC event, registering GPUs not yet watched first.

        None on timeout, after close(), or (after sleeping timeout_s) when no GPU supports these events.
        """
        with self._event_lock:
            if self._closed:
                return None
            self._register_events()
            if self._event_set is None:
                time.sleep(max(0.0, timeout_s))  # no GPU can report events: wait out the timeout
                return None
            timeout_ms = min(max(0, int(timeout_s * 1000)), 2**31 - 1)
            data = self._q.call("nvmlEventSetWait_v2", self._event_set, timeout_ms, absent=(ERR_TIMEOUT,))
        if data is None:
            return None
        return self._to_event(data)

    def close(self) -> None:
        """Free the GPM buffers and the event set and shut NVML down; later calls do nothing."""
        with self._event_lock:
            if self._closed:
                return
            self._closed = True
            self._gpm.free_all()
            if self._event_set is not None:
                self._q.call("nvmlEventSetFree", self._event_set, absent=(ERR_UNINITIALIZED,))
                self._event_set = None
            self._q.call("nvmlShutdown", absent=(ERR_UNINITIALIZED,))

    # -- MIG partitioning (MigPartitioner) --------------------------------------------------------

    def create_mig(self, gpu_uuid: str, profile: str, start: int) -> str:
        """Create a MIG instance of `profile` at memory slice `start` (see nvml/partition.py); its UUID."""
        handle = self._handle(gpu_uuid)
        gpu = next((g for g in self.gpus() if g.uuid == gpu_uuid), None)
        if gpu is None or not gpu.mig_enabled:
            raise BackendError(f"GPU {gpu_uuid} is not in MIG mode; no MIG instance can be created on it")
        table = table_of_model(gpu.model, gpu.memory_total_bytes)
        if table is None:
            raise BackendError(
                f"GPU {gpu_uuid} ({gpu.model}): gpunode knows no MIG profile table of this model"
            )
        gi_id, ci_id = partition.create(self._q, handle, gpu_uuid, table, profile, start)
        for mig in next((g for g in self.gpus() if g.uuid == gpu_uuid), gpu).mig_devices:
            if mig.gi_id == gi_id and mig.ci_id == ci_id:
                return mig.uuid
        raise BackendError(
            f"GPU {gpu_uuid}: MIG instance {profile} at memory slice {start} was created (GPU instance {gi_id}) "
            "but NVML lists no MIG device for it"
        )

    def destroy_mig(self, mig_uuid: str) -> None:
        """Destroy a MIG device's compute and GPU instance (see nvml/partition.py)."""
        partition.destroy(self._q, mig_uuid)

    # -- discovery --------------------------------------------------------------------------------

    def _handle(self, uuid: str) -> Any:
        with self._lock:
            handle = self._handles.get(uuid)
        if handle is not None:
            return handle
        handle = self._q.call("nvmlDeviceGetHandleByUUID", uuid, uuid=uuid)
        if handle is None:
            raise DeviceNotFound(f"NVML knows no GPU {uuid}")
        with self._lock:
            self._handles[uuid] = handle
        return handle

    def _discover(self, index: int, ref: str) -> tuple[Gpu, Any]:
        q = self._q
        handle = q.require("nvmlDeviceGetHandleByIndex", index, uuid=ref)
        uuid = str(q.require("nvmlDeviceGetUUID", handle, uuid=ref))
        memory = memory_total(q, handle, uuid)
        try:
            bus = normalize_pci_bus_id(str(q.require("nvmlDeviceGetPciInfo", handle, uuid=uuid).busId))
        except ValueError as exc:
            raise BackendError(f"GPU {uuid}: NVML reports a bus ID gpunode cannot use: {exc}") from None
        arch = q.call("nvmlDeviceGetArchitecture", handle, uuid=uuid)
        mig_mode = q.call("nvmlDeviceGetMigMode", handle, uuid=uuid)
        mig_enabled = bool(mig_mode) and int(mig_mode[0]) == 1
        migs = discover_mig(q, handle, uuid) if mig_enabled else ()
        with self._lock:
            self._mig[uuid] = migs
        gpu = Gpu(
            index=index,
            uuid=uuid,
            model=str(q.require("nvmlDeviceGetName", handle, uuid=uuid)),
            memory_total_bytes=memory,
            pci_bus_id=bus,
            numa_node=numa_node(q, self._sysfs, handle, uuid, bus),
            minor=minor_number(q, self._procfs, handle, uuid, bus),
            mig_enabled=mig_enabled,
            mig_devices=tuple(m for _, m in migs),
            architecture=_ARCHITECTURES.get(int(arch)) if arch is not None else None,
        )
        return gpu, handle

    # -- probe and events ---------------------------------------------------------------------------

    def _probe_now(self, uuid: str) -> GpuProbe:
        q = self._q
        handle = self._handle(uuid)
        q.require("nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU, uuid=uuid)
        retired = q.call("nvmlDeviceGetRetiredPagesPendingStatus", handle, uuid=uuid)
        remap = q.call("nvmlDeviceGetRemappedRows", handle, uuid=uuid)
        energy_mj = q.call("nvmlDeviceGetTotalEnergyConsumption", handle, uuid=uuid)
        return GpuProbe(
            uuid=uuid,
            reachable=True,
            retired_pages_pending=bool(retired) if retired is not None else None,
            row_remap_pending=bool(remap[2]) if remap is not None else None,
            row_remap_failure=bool(remap[3]) if remap is not None else None,
            ecc_sbe_volatile=_opt_int(self._ecc(handle, uuid, NVML_MEMORY_ERROR_TYPE_CORRECTED)),
            ecc_dbe_volatile=_opt_int(self._ecc(handle, uuid, NVML_MEMORY_ERROR_TYPE_UNCORRECTED)),
            energy_j=int(energy_mj) / 1000.0 if energy_mj is not None else None,
        )

    def _ecc(self, handle: Any, uuid: str, kind: int) -> Any:
        return self._q.call("nvmlDeviceGetTotalEccErrors", handle, kind, NVML_VOLATILE_ECC, uuid=uuid)

    def _register_events(self) -> None:
        """Create the event set once and register every GPU not yet registered (new GPUs after hot-plug)."""
        q = self._q
        with self._lock:
            known = dict(self._handles)
        if not known:
            self.gpus()
            with self._lock:
                known = dict(self._handles)
        wanted = EVENT_XID_CRITICAL | EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC
        for uuid, handle in known.items():
            if uuid in self._registered:
                continue
            try:
                supported = q.call("nvmlDeviceGetSupportedEventTypes", handle, uuid=uuid)
                mask = int(supported or 0) & wanted
                if mask:
                    if self._event_set is None:
                        self._event_set = q.require("nvmlEventSetCreate")
                    q.call("nvmlDeviceRegisterEvents", handle, mask, self._event_set, uuid=uuid)
            except GpuLostError:
                log.warning("GPU %s is lost; its XID and ECC events are not watched", uuid)
                continue
            self._registered.add(uuid)

    def _to_event(self, data: Any) -> DeviceEvent:
        uuid = self._uuid_of_handle(data.device) if data.device else None
        mig_uuid = self._mig_of(uuid, int(data.gpuInstanceId), int(data.computeInstanceId))
        etype = int(data.eventType)
        if etype & EVENT_XID_CRITICAL:
            return DeviceEvent(kind=EventKind.XID, gpu_uuid=uuid, mig_uuid=mig_uuid, xid=int(data.eventData))
        if etype & EVENT_DOUBLE_BIT_ECC:
            return DeviceEvent(kind=EventKind.ECC_DBE, gpu_uuid=uuid, mig_uuid=mig_uuid)
        if etype & EVENT_SINGLE_BIT_ECC:
            return DeviceEvent(kind=EventKind.ECC_SBE, gpu_uuid=uuid, mig_uuid=mig_uuid)
        # Only the three kinds above are registered; anything else is reported as an XID without a code.
        return DeviceEvent(kind=EventKind.XID, gpu_uuid=uuid, mig_uuid=mig_uuid, xid=None)

    def _uuid_of_handle(self, handle: Any) -> str | None:
        """The UUID of the GPU an event came from; a lost GPU is found among the known handles."""
        try:
            uuid = self._q.call("nvmlDeviceGetUUID", handle)
        except BackendError:
            uuid = None
        if uuid is not None:
            return str(uuid)
        address = _address(handle)
        with self._lock:
            return next((u for u, h in self._handles.items() if _address(h) == address), None)

    def _mig_of(self, uuid: str | None, gi: int, ci: int) -> str | None:
        """The MIG device an event names by GPU/compute instance ID (ci may be unset)."""
        if uuid is None or gi == INVALID_INSTANCE_ID:
            return None
        with self._lock:
            candidates = [m for _, m in self._mig.get(uuid, ()) if m.gi_id == gi]
        exact = [m for m in candidates if m.ci_id == ci]
        chosen = exact or candidates
        return chosen[0].uuid if chosen else None


def _address(handle: Any) -> int | None:
    """The address an NVML device handle (a ctypes pointer) points to."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def _opt_int(value: Any) -> int | None:
    return int(value) if value is not None else None
