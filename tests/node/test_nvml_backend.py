"""NvmlBackend against a fake NVML module that behaves like pynvml.

The fake raises pynvml's own NVMLError subclasses with NVML's return codes and
returns pynvml's own ctypes structures (device handles and GPM samples are real
ctypes pointers), so the backend's translation, discovery and mapping code runs
exactly as it does over the real library.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpunode.errors import BackendError, BackendUnavailable, ConfigError, DeviceNotFound, GpuLostError
from gpunode.node.devices.base import Backend, EventKind
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.devices.select import detect_backend
from gpunode.node.devices.simnode.backend import SimBackend

MIB = 2**20
E = pynvml  # NVML_ERROR_* codes and constants come from the real module


@dataclass
class FakeMig:
    profile: str
    gi: int
    ci: int
    slices: int
    memory_mib: int
    used_mib: int = 0
    uuid: str = ""
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    gr_util_pct: float = 40.0


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_mib: int = 81559
    used_mib: int = 1024
    reserved_mib: int = 512
    minor: int = 0
    numa: int | None = 0
    arch: int = 9  # hopper
    mig: list[FakeMig] | None = None
    links: list[tuple[int, int | None, str | None]] = field(default_factory=list)  # (active, type, bus)
    lost: bool = False
    hang: threading.Event | None = None
    fail: dict[str, int] = field(default_factory=dict)  # function name -> NVML error code
    events: int = (
        E.nvmlEventTypeXidCriticalError | E.nvmlEventTypeSingleBitEccError | E.nvmlEventTypeDoubleBitEccError
    )
    gpm: bool = True
    virtualization: int = 0
    licensed: bool = False
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)


class FakeNvml:
    """Enough of pynvml's surface for NvmlBackend, over a list of FakeGpu."""

    def __init__(
        self, gpus: list[FakeGpu], *, init_error: int | None = None, driver: str = "550.90.07"
    ) -> None:
        for name in dir(pynvml):
            if name.startswith(
                ("NVML_", "nvmlEventType", "nvmlMemory_v2", "c_nvml", "NVMLError", "NVMLLibrary")
            ):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = pynvml.NVMLError
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.calls: list[str] = []
        self.shutdown = False
        self._buffers: dict[int, Any] = {}
        self._handles: dict[int, tuple[int, int | None]] = {}
        self.gpm_live: dict[int, dict[str, Any]] = {}
        self.event_sets: dict[int, dict[int, int]] = {}  # set address -> GPU index -> mask
        self.pending: list[tuple[int, int, int, int, int]] = []  # gpu, type, data, gi, ci
        self.pending_ready = threading.Condition()
        self.clock = 100.0
        self.power_mw = 245_000
        self.energy_mj = 123_456_789

    # -- plumbing ------------------------------------------------------------------------------

    def _pointer(self, kind: Any) -> Any:
        buf = ctypes.create_string_buffer(16)
        self._buffers[ctypes.addressof(buf)] = buf
        return ctypes.cast(buf, kind)

    def _handle(self, index: int, mig: int | None = None) -> Any:
        for address, key in self._handles.items():
            if key == (index, mig):
                return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)
        ptr = self._pointer(pynvml.c_nvmlDevice_t)
        self._handles[ctypes.cast(ptr, ctypes.c_void_p).value or 0] = (index, mig)
        return ptr

    def _dev(self, handle: Any, fn: str) -> tuple[FakeGpu, FakeMig | None]:
        self.calls.append(fn)
        key = self._handles.get(ctypes.cast(handle, ctypes.c_void_p).value or 0)
        if key is None:
            raise pynvml.NVMLError(E.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[key[0]]
        if gpu.hang is not None:
            gpu.hang.wait()
        if gpu.lost:
            raise pynvml.NVMLError(E.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.fail:
            raise pynvml.NVMLError(gpu.fail[fn])
        mig = gpu.mig[key[1]] if key[1] is not None and gpu.mig is not None else None
        return gpu, mig

    # -- system --------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(E.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise pynvml.NVMLError(E.NVML_ERROR_GPU_IS_LOST)
        return self._handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        for i, g in enumerate(self.gpus):
            if g.uuid == uuid:
                if g.lost:
                    raise pynvml.NVMLError(E.NVML_ERROR_GPU_IS_LOST)
                return self._handle(i)
        raise pynvml.NVMLError(E.NVML_ERROR_NOT_FOUND)

    # -- identity and topology -----------------------------------------------------------------

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        gpu, mig = self._dev(h, "nvmlDeviceGetUUID")
        return mig.uuid if mig else gpu.uuid

    def nvmlDeviceGetName(self, h: Any) -> str:
        gpu, mig = self._dev(h, "nvmlDeviceGetName")
        return f"{gpu.name} MIG {mig.profile}" if mig else gpu.name

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        gpu, _ = self._dev(h, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        return info

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: int | None = None) -> Any:
        gpu, mig = self._dev(h, "nvmlDeviceGetMemoryInfo")
        total, used = (mig.memory_mib, mig.used_mib) if mig else (gpu.memory_mib, gpu.used_mib)
        reserved = 0 if mig else gpu.reserved_mib
        info = pynvml.c_nvmlMemory_v2_t() if version else pynvml.c_nvmlMemory_t()
        if version:
            info.version = version
            info.reserved = reserved * MIB
        else:
            used += reserved  # the v1 call counts reserved memory as used
            reserved = 0
        info.total, info.used, info.free = total * MIB, used * MIB, (total - used - reserved) * MIB
        return info

    def nvmlDeviceGetNumaNodeId(self, h: Any) -> int:
        gpu, _ = self._dev(h, "nvmlDeviceGetNumaNodeId")
        if gpu.numa is None:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        return gpu.numa

    def nvmlDeviceGetMinorNumber(self, h: Any) -> int:
        return self._dev(h, "nvmlDeviceGetMinorNumber")[0].minor

    def nvmlDeviceGetArchitecture(self, h: Any) -> int:
        return self._dev(h, "nvmlDeviceGetArchitecture")[0].arch

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        gpu, _ = self._dev(h, "nvmlDeviceGetMigMode")
        if gpu.arch < 7:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        on = int(gpu.mig is not None)
        return [on, on]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return 7 if self._dev(h, "nvmlDeviceGetMaxMigDeviceCount")[0].mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, index: int) -> Any:
        gpu, _ = self._dev(h, "nvmlDeviceGetMigDeviceHandleByIndex")
        if gpu.mig is None or index >= len(gpu.mig):
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_FOUND)
        return self._handle(self.gpus.index(gpu), index)

    def nvmlDeviceGetAttributes(self, h: Any) -> Any:
        _, mig = self._dev(h, "nvmlDeviceGetAttributes")
        if mig is None:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        attrs = pynvml.c_nvmlDeviceAttributes()
        attrs.gpuInstanceSliceCount = mig.slices
        attrs.computeInstanceSliceCount = mig.slices
        attrs.memorySizeMB = mig.memory_mib
        return attrs

    def nvmlDeviceGetGpuInstanceId(self, h: Any) -> int:
        mig = self._dev(h, "nvmlDeviceGetGpuInstanceId")[1]
        assert mig is not None
        return mig.gi

    def nvmlDeviceGetComputeInstanceId(self, h: Any) -> int:
        mig = self._dev(h, "nvmlDeviceGetComputeInstanceId")[1]
        assert mig is not None
        return mig.ci

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        gpu, _ = self._dev(h, "nvmlDeviceGetNvLinkState")
        if not gpu.links:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(gpu.links):
            raise pynvml.NVMLError(E.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link][0]

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Any, link: int) -> int:
        gpu, _ = self._dev(h, "nvmlDeviceGetNvLinkRemoteDeviceType")
        kind = gpu.links[link][1]
        if kind is None:
            raise pynvml.NVMLError(E.NVML_ERROR_FUNCTION_NOT_FOUND)  # a driver without this call
        return kind

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Any, link: int) -> Any:
        gpu, _ = self._dev(h, "nvmlDeviceGetNvLinkRemotePciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = (gpu.links[link][2] or "").encode()
        return info

    # -- telemetry -----------------------------------------------------------------------------

    def nvmlDeviceGetClockInfo(self, h: Any, kind: int) -> int:
        self._dev(h, "nvmlDeviceGetClockInfo")
        return {E.NVML_CLOCK_SM: 1980, E.NVML_CLOCK_MEM: 2619}[kind]

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        self._dev(h, "nvmlDeviceGetTemperature")
        assert sensor == E.NVML_TEMPERATURE_GPU
        return 41

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        self._dev(h, "nvmlDeviceGetPowerUsage")
        return self.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any) -> int:
        self._dev(h, "nvmlDeviceGetTotalEnergyConsumption")
        return self.energy_mj

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        self._dev(h, "nvmlDeviceGetPcieReplayCounter")
        return 3

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        gpu, _ = self._dev(h, "nvmlDeviceGetUtilizationRates")
        if gpu.mig is not None:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        util = pynvml.c_nvmlUtilization_t()
        util.gpu, util.memory = 57, 23
        return util

    def nvmlDeviceGetEncoderUtilization(self, h: Any) -> list[int]:
        self._dev(h, "nvmlDeviceGetEncoderUtilization")
        return [5, 167000]

    def nvmlDeviceGetDecoderUtilization(self, h: Any) -> list[int]:
        self._dev(h, "nvmlDeviceGetDecoderUtilization")
        return [12, 167000]

    def nvmlDeviceGetFieldValues(self, h: Any, field_ids: list[Any]) -> Any:
        gpu, _ = self._dev(h, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        known = {
            E.NVML_FI_DEV_MEMORY_TEMP: (E.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 48),
            E.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX: (E.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 1000),
            E.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX: (E.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 3000),
        }
        for i, f in enumerate(field_ids):
            fid, scope = f if isinstance(f, tuple) else (f, 0)
            values[i].fieldId, values[i].scopeId = fid, scope
            nvlink = fid in (E.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, E.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX)
            if (
                fid not in known
                or (nvlink and not gpu.links)
                or (fid == E.NVML_FI_DEV_MEMORY_TEMP and gpu.arch < 7)
            ):
                values[i].nvmlReturn = E.NVML_ERROR_NOT_SUPPORTED
                continue
            if nvlink:
                assert scope == 0xFFFFFFFF, "all links"
            kind, attr, value = known[fid]
            values[i].valueType = kind
            setattr(values[i].value, attr, value)
            values[i].nvmlReturn = E.NVML_SUCCESS
        return values

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        gpu, _ = self._dev(h, "nvmlDeviceGetRemappedRows")
        if gpu.arch < 7:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        return (2, 1, 1, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int:
        gpu, _ = self._dev(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        if gpu.arch >= 7:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        return 1

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter: int) -> int:
        self._dev(h, "nvmlDeviceGetTotalEccErrors")
        assert counter == E.NVML_VOLATILE_ECC
        return {E.NVML_MEMORY_ERROR_TYPE_CORRECTED: 7, E.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 1}[error_type]

    def nvmlDeviceGetVirtualizationMode(self, h: Any) -> int:
        return self._dev(h, "nvmlDeviceGetVirtualizationMode")[0].virtualization

    def nvmlDeviceGetGridLicensableFeatures(self, h: Any) -> Any:
        gpu, _ = self._dev(h, "nvmlDeviceGetGridLicensableFeatures")
        features = pynvml.c_nvmlGridLicensableFeatures_v4_t()
        features.isGridLicenseSupported = 1
        features.licensableFeaturesCount = 1
        features.gridLicensableFeatures[0].featureState = int(gpu.licensed)
        return features

    # -- GPM -------------------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, h: Any) -> Any:
        gpu, _ = self._dev(h, "nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.isSupportedDevice = int(gpu.gpm)
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        sample = self._pointer(pynvml.c_nvmlGpmSample_t)
        self.gpm_live[ctypes.cast(sample, ctypes.c_void_p).value or 0] = {}
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        address = ctypes.cast(sample, ctypes.c_void_p).value or 0
        if address not in self.gpm_live:
            raise pynvml.NVMLError(E.NVML_ERROR_INVALID_ARGUMENT)  # a double free
        del self.gpm_live[address]

    def _gpm_take(self, sample: Any, gpu: FakeGpu, mig: FakeMig | None) -> Any:
        record = self.gpm_live[ctypes.cast(sample, ctypes.c_void_p).value or 0]
        record.update(t=self.clock, gpu=gpu, mig=mig)
        return sample

    def nvmlGpmSampleGet(self, h: Any, sample: Any) -> Any:
        gpu, _ = self._dev(h, "nvmlGpmSampleGet")
        return self._gpm_take(sample, gpu, None)

    def nvmlGpmMigSampleGet(self, h: Any, gi: int, sample: Any) -> Any:
        gpu, _ = self._dev(h, "nvmlGpmMigSampleGet")
        mig = next(m for m in gpu.mig or [] if m.gi == gi)
        return self._gpm_take(sample, gpu, mig)

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        first = self.gpm_live[ctypes.cast(request.sample1, ctypes.c_void_p).value or 0]
        second = self.gpm_live[ctypes.cast(request.sample2, ctypes.c_void_p).value or 0]
        assert request.version == pynvml.NVML_GPM_METRICS_GET_VERSION and second["t"] > first["t"]
        mig = second["mig"]
        values = {
            E.NVML_GPM_METRIC_GRAPHICS_UTIL: mig.gr_util_pct if mig else 80.0,
            E.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 35.0,
            E.NVML_GPM_METRIC_DRAM_BW_UTIL: 150.0,  # out of range on purpose: the backend clamps
            E.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 2.0,
            E.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 0.5,
        }
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            metric.nvmlReturn = E.NVML_SUCCESS
            metric.value = values[metric.metricId]
        return request

    # -- processes -----------------------------------------------------------------------------

    def _procs(self, h: Any, fn: str, graphics: bool) -> list[Any]:
        gpu, mig = self._dev(h, fn)
        if gpu.mig is not None and mig is None:
            raise pynvml.NVMLError(E.NVML_ERROR_NO_PERMISSION)  # the aggregate needs privileges
        rows = (
            (mig.processes if not graphics else []) if mig else (gpu.graphics if graphics else gpu.processes)
        )
        return [pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": used}) for pid, used in rows]

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        return self._procs(h, "nvmlDeviceGetComputeRunningProcesses", False)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        return self._procs(h, "nvmlDeviceGetGraphicsRunningProcesses", True)

    # -- events ----------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        gpu, _ = self._dev(h, "nvmlDeviceGetSupportedEventTypes")
        if not gpu.events:
            raise pynvml.NVMLError(E.NVML_ERROR_NOT_SUPPORTED)
        return gpu.events | E.nvmlEventTypePState

    def nvmlEventSetCreate(self) -> Any:
        event_set = self._pointer(pynvml.c_nvmlEventSet_t)
        self.event_sets[ctypes.cast(event_set, ctypes.c_void_p).value or 0] = {}
        return event_set

    def nvmlDeviceRegisterEvents(self, h: Any, mask: int, event_set: Any) -> None:
        gpu, _ = self._dev(h, "nvmlDeviceRegisterEvents")
        self.event_sets[ctypes.cast(event_set, ctypes.c_void_p).value or 0][self.gpus.index(gpu)] = mask

    def nvmlEventSetFree(self, event_set: Any) -> None:
        del self.event_sets[ctypes.cast(event_set, ctypes.c_void_p).value or 0]

    def emit(self, gpu: int, kind: int, data: int = 0, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> None:
        with self.pending_ready:
            self.pending.append((gpu, kind, data, gi, ci))
            self.pending_ready.notify_all()

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        masks = self.event_sets[ctypes.cast(event_set, ctypes.c_void_p).value or 0]
        deadline = time.monotonic() + timeout_ms / 1000
        with self.pending_ready:
            while True:
                for item in list(self.pending):
                    if masks.get(item[0], 0) & item[1]:
                        self.pending.remove(item)
                        data = pynvml.c_nvmlEventData_t()
                        data.device = self._handle(item[0])
                        data.eventType, data.eventData = item[1], item[2]
                        data.gpuInstanceId, data.computeInstanceId = item[3], item[4]
                        return data
                left = deadline - time.monotonic()
                if left <= 0:
                    raise pynvml.NVMLError(E.NVML_ERROR_TIMEOUT)
                self.pending_ready.wait(left)


def switch_links(count: int = 18) -> list[tuple[int, int | None, str | None]]:
    return [(1, E.NVML_NVLINK_DEVICE_TYPE_SWITCH, "00000000:C3:00.0")] * count


DGX_BUSES = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]


def dgx_h100() -> list[FakeGpu]:
    return [
        FakeGpu(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", bus_id=f"00000000:{bus}:00.0", minor=i,
                numa=i // 4, links=switch_links())
        for i, bus in enumerate(DGX_BUSES)
    ]  # fmt: skip


def a100_mig() -> list[FakeGpu]:
    def migs(*rows: tuple[str, int, int, int]) -> list[FakeMig]:
        return [
            FakeMig(p, gi, 0, s, mem, uuid=f"MIG-{gi:08x}-{k:04x}-0000-0000-000000000000")
            for k, (p, gi, s, mem) in enumerate(rows)
        ]

    gpus = [
        FakeGpu(uuid="GPU-a0000000-0000-0000-0000-000000000000", bus_id="00000000:07:00.0", name="NVIDIA A100-SXM4-80GB",
                memory_mib=81920, arch=7, links=switch_links(12),
                mig=migs(("3g.40gb", 2, 3, 40192), ("2g.20gb", 3, 2, 19968), ("1g.10gb", 9, 1, 9728))),
        FakeGpu(uuid="GPU-a1000000-0000-0000-0000-000000000000", bus_id="0000:0F:00.0", name="NVIDIA A100-SXM4-80GB",
                memory_mib=81920, arch=7, minor=1, links=switch_links(12)),
    ]  # fmt: skip
    for i, m in enumerate(gpus[0].mig or []):
        m.uuid = f"MIG-a0{i:06x}-0000-0000-0000-000000000000"
    return gpus


def t4_pair() -> list[FakeGpu]:
    return [
        FakeGpu(uuid=f"GPU-7{i:07x}-0000-0000-0000-000000000000", bus_id=f"00000000:{bus}:00.0", name="Tesla T4",
                memory_mib=15360, arch=6, minor=i, numa=None, gpm=False)
        for i, bus in enumerate(["3B", "AF"])
    ]  # fmt: skip


@pytest.fixture
def released() -> Iterator[list[threading.Event]]:
    """Hang events a test sets on fake GPUs; released at the end so no thread stays blocked."""
    events: list[threading.Event] = []
    yield events
    for e in events:
        e.set()


# -- error translation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (E.NVML_ERROR_NOT_SUPPORTED, None),
        (E.NVML_ERROR_NOT_FOUND, None),
        (E.NVML_ERROR_NO_PERMISSION, None),
        (E.NVML_ERROR_FUNCTION_NOT_FOUND, None),
        (E.NVML_ERROR_NO_DATA, None),
        (E.NVML_ERROR_GPU_IS_LOST, GpuLostError),
        (E.NVML_ERROR_GPU_NOT_FOUND, GpuLostError),
        (E.NVML_ERROR_RESET_REQUIRED, GpuLostError),
        (E.NVML_ERROR_DRIVER_NOT_LOADED, BackendUnavailable),
        (E.NVML_ERROR_LIB_RM_VERSION_MISMATCH, BackendUnavailable),
        (E.NVML_ERROR_INVALID_ARGUMENT, BackendError),
        (E.NVML_ERROR_INSUFFICIENT_POWER, BackendError),
        (E.NVML_ERROR_UNKNOWN, BackendError),  # the GPU still answers to its UUID: not a lost GPU
    ],
    ids=lambda v: (
        pynvml.NVMLError(v).__class__.__name__ if isinstance(v, int) else getattr(v, "__name__", "absent")
    ),
)
def test_nvml_errors_are_translated(code: int, outcome: type[Exception] | None) -> None:
    gpus = dgx_h100()
    gpus[0].fail["nvmlDeviceGetPowerUsage"] = code
    backend = NvmlBackend(nvml=FakeNvml(gpus))
    uuid = backend.gpus()[0].uuid
    if outcome is None:
        sample = backend.sample(uuid)
        assert sample.power_w is None and sample.gpu_temp_c == 41.0
        return
    with pytest.raises(outcome) as err:
        backend.sample(uuid)
    assert type(err.value) is outcome
    assert err.value.hint
    if outcome is GpuLostError:
        assert isinstance(err.value, GpuLostError) and err.value.uuid == uuid
    if outcome is BackendError:
        assert isinstance(err.value, BackendError)
        assert "nvmlDeviceGetPowerUsage" in str(err.value) and uuid in str(err.value)


def test_unknown_error_from_a_vanished_gpu_is_a_lost_gpu() -> None:
    fake = FakeNvml(dgx_h100())
    backend = NvmlBackend(nvml=fake)
    gpu = backend.gpus()[4]
    fake.gpus[4].fail["nvmlDeviceGetClockInfo"] = E.NVML_ERROR_UNKNOWN
    fake.gpus[4].uuid = "GPU-renamed"  # the old UUID no longer answers: the device vanished
    with pytest.raises(GpuLostError) as err:
        backend.sample(gpu.uuid)
    assert err.value.uuid == gpu.uuid


class OldNvml(FakeNvml):
    """An nvidia-ml-py from before nvmlDeviceGetTotalEnergyConsumption existed."""

    def __getattribute__(self, name: str) -> Any:
        if name == "nvmlDeviceGetTotalEnergyConsumption":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_function_missing_from_nvidia_ml_py_reads_as_absent() -> None:
    backend = NvmlBackend(nvml=OldNvml(dgx_h100()))
    s = backend.sample(backend.gpus()[0].uuid)
    assert s.total_energy_j is None and s.power_w == 245.0


@pytest.mark.parametrize(
    ("code", "message", "hint"),
    [
        (E.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1", "--backend sim"),
        (E.NVML_ERROR_DRIVER_NOT_LOADED, "kernel driver is not loaded", "--backend sim"),
        (E.NVML_ERROR_NO_PERMISSION, "no permission", "/dev/nvidiactl"),
        (E.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "different versions", "reboot"),
    ],
    ids=["library-missing", "driver-not-loaded", "no-permission", "version-mismatch"],
)
def test_nvml_that_cannot_start_is_unavailable_with_a_hint(code: int, message: str, hint: str) -> None:
    with pytest.raises(BackendUnavailable) as err:
        NvmlBackend(nvml=FakeNvml([], init_error=code))
    assert message in str(err.value)
    assert hint in err.value.hint


def test_the_real_library_is_missing_here_or_answers() -> None:
    try:
        backend = NvmlBackend()
    except BackendUnavailable as e:
        assert "--backend sim" in e.hint or "reboot" in e.hint or "/dev/nvidia" in e.hint
        return
    try:  # a machine with the NVIDIA driver: the backend must at least list what NVML sees
        assert isinstance(backend.gpus(), tuple)
    finally:
        backend.close()


# -- discovery -----------------------------------------------------------------------------------


def test_discovery_of_an_nvswitch_node() -> None:
    backend = NvmlBackend(nvml=FakeNvml(dgx_h100()))
    assert isinstance(backend, Backend) and backend.name == "nvml"
    assert backend.driver_version() == "550.90.07"
    gpus = backend.gpus()
    assert [g.index for g in gpus] == list(range(8))
    assert [g.pci_bus_id for g in gpus] == [f"00000000:{b}:00.0" for b in DGX_BUSES]
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.minor for g in gpus] == list(range(8))
    assert {g.memory_total_bytes for g in gpus} == {81559 * MIB}
    assert {g.architecture for g in gpus} == {"hopper"}
    assert not any(g.mig_enabled for g in gpus)
    for g in gpus:
        assert g.nvlink_peers == tuple(o.uuid for o in gpus if o is not g)


def test_direct_links_between_gpus_make_pairs_and_inactive_links_are_ignored() -> None:
    gpus = [FakeGpu(uuid=f"GPU-{i}", bus_id=f"0000:{0x10 + i:02X}:00.0", minor=i) for i in range(4)]
    gpus[0].links = [
        (1, E.NVML_NVLINK_DEVICE_TYPE_GPU, "00000000:11:00.0"),
        (0, E.NVML_NVLINK_DEVICE_TYPE_GPU, "00000000:12:00.0"),
    ]
    gpus[1].links = [(1, E.NVML_NVLINK_DEVICE_TYPE_GPU, "0000:10:00.0")]
    gpus[2].links = [(1, None, "00000000:13:00.0")]  # a driver that cannot tell the remote type
    gpus[3].links = [(1, E.NVML_NVLINK_DEVICE_TYPE_IBMNPU, "00000000:40:00.0")]
    peers = {g.uuid: g.nvlink_peers for g in NvmlBackend(nvml=FakeNvml(gpus)).gpus()}
    assert peers == {"GPU-0": ("GPU-1",), "GPU-1": ("GPU-0",), "GPU-2": ("GPU-3",), "GPU-3": ("GPU-2",)}


def test_pcie_gpus_without_nvlink_have_no_peers_and_numa_comes_from_sysfs(tmp_path: Path) -> None:
    for bdf, node in (("0000:3b:00.0", "0\n"), ("0000:af:00.0", "-1\n")):
        (tmp_path / "bus/pci/devices" / bdf).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / bdf / "numa_node").write_text(node)
    gpus = NvmlBackend(nvml=FakeNvml(t4_pair()), sysfs_root=tmp_path).gpus()
    assert [g.nvlink_peers for g in gpus] == [(), ()]
    assert [g.numa_node for g in gpus] == [0, None]  # -1 in sysfs means no NUMA affinity
    assert [g.architecture for g in gpus] == ["turing", "turing"]
    assert not any(g.mig_enabled for g in gpus)


def test_minor_number_falls_back_to_procfs(tmp_path: Path) -> None:
    gpus = t4_pair()
    gpus[1].fail["nvmlDeviceGetMinorNumber"] = E.NVML_ERROR_NOT_SUPPORTED
    info = tmp_path / "driver/nvidia/gpus/0000:af:00.0/information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t\t Tesla T4\nIRQ:   \t\t 98\nDevice Minor: \t 5\n")
    assert NvmlBackend(nvml=FakeNvml(gpus), procfs_root=tmp_path).gpus()[1].minor == 5
    with pytest.raises(BackendError) as err:
        NvmlBackend(nvml=FakeNvml(gpus), procfs_root=tmp_path / "none").gpus()
    assert "minor number" in str(err.value)


def test_mig_devices_are_discovered_with_profiles_and_instance_ids() -> None:
    gpus = NvmlBackend(nvml=FakeNvml(a100_mig())).gpus()
    mig_gpu, whole = gpus
    assert mig_gpu.mig_enabled and not whole.mig_enabled and whole.mig_devices == ()
    assert whole.pci_bus_id == "00000000:0F:00.0"
    assert [(m.profile, m.gi_id, m.ci_id, m.slices, m.memory_total_bytes) for m in mig_gpu.mig_devices] == [
        ("3g.40gb", 2, 0, 3, 40192 * MIB),
        ("2g.20gb", 3, 0, 2, 19968 * MIB),
        ("1g.10gb", 9, 0, 1, 9728 * MIB),
    ]
    assert [m.index for m in mig_gpu.mig_devices] == [0, 1, 2]
    assert {m.parent_uuid for m in mig_gpu.mig_devices} == {mig_gpu.uuid}
    assert mig_gpu.nvlink_peers == (whole.uuid,)


def test_a_gpu_lost_after_discovery_stays_listed_and_one_never_seen_is_skipped() -> None:
    fake = FakeNvml(dgx_h100())
    backend = NvmlBackend(nvml=fake)
    first = backend.gpus()
    fake.gpus[2].lost = True
    again = backend.gpus()
    assert [g.uuid for g in again] == [g.uuid for g in first]
    assert again[2] == first[2]
    fresh = NvmlBackend(nvml=fake)
    assert [g.index for g in fresh.gpus()] == [0, 1, 3, 4, 5, 6, 7]


# -- telemetry -----------------------------------------------------------------------------------


def test_sample_maps_nvml_readings_to_base_units() -> None:
    fake = FakeNvml(dgx_h100())
    backend = NvmlBackend(nvml=fake)
    uuid = backend.gpus()[0].uuid
    first = backend.sample(uuid)
    assert first.gr_engine_active is None and first.pcie_tx_bytes_per_s is None  # GPM needs two samples
    fake.clock += 1
    s = backend.sample(uuid)
    assert s.uuid == uuid
    assert (s.sm_clock_hz, s.mem_clock_hz) == (1980e6, 2619e6)
    assert (s.gpu_temp_c, s.memory_temp_c) == (41.0, 48.0)
    assert s.power_w == 245.0
    assert s.total_energy_j == pytest.approx(123456.789)
    assert s.pcie_replay_count == 3
    assert (s.gpu_util, s.mem_copy_util, s.enc_util, s.dec_util) == (0.57, 0.23, 0.05, 0.12)
    assert (s.memory_used_bytes, s.memory_reserved_bytes) == (1024 * MIB, 512 * MIB)
    assert s.memory_free_bytes == (81559 - 1024 - 512) * MIB
    assert s.nvlink_bandwidth_total_bytes == (1000 + 3000) * 1024
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (2, 1)
    assert (s.row_remap_pending, s.row_remap_failure) == (True, False)
    assert (s.ecc_sbe_volatile, s.ecc_dbe_volatile) == (7, 1)
    assert (s.gr_engine_active, s.tensor_active, s.dram_active) == (0.8, 0.35, 1.0)
    assert (s.pcie_tx_bytes_per_s, s.pcie_rx_bytes_per_s) == (2.0 * MIB, 0.5 * MIB)
    assert s.vgpu_license_status is None and s.mig == ()
    assert len(fake.gpm_live) == 1  # only the latest GPM sample is kept


def test_a_gpu_without_optional_features_reads_none() -> None:
    fake = FakeNvml(t4_pair())
    backend = NvmlBackend(nvml=fake)
    uuid = backend.gpus()[1].uuid
    backend.sample(uuid)
    s = backend.sample(uuid)
    missing = ["memory_temp_c", "nvlink_bandwidth_total_bytes", "remapped_rows_correctable", "row_remap_pending",
               "gr_engine_active", "tensor_active", "dram_active", "pcie_rx_bytes_per_s", "vgpu_license_status"]  # fmt: skip
    assert [f for f in missing if getattr(s, f) is not None] == []
    assert s.gpu_util == 0.57 and s.power_w == 245.0


def test_memory_falls_back_to_the_v1_call_without_reserved() -> None:
    fake = FakeNvml(dgx_h100())
    backend = NvmlBackend(nvml=fake)
    original = fake.nvmlDeviceGetMemoryInfo

    def v1_only(h: Any, version: int | None = None) -> Any:
        if version:
            raise pynvml.NVMLError(E.NVML_ERROR_FUNCTION_NOT_FOUND)
        return original(h)

    fake.nvmlDeviceGetMemoryInfo = v1_only  # type: ignore[method-assign]
    gpu = backend.gpus()[1]
    assert gpu.memory_total_bytes == 81559 * MIB
    s = backend.sample(gpu.uuid)
    assert s.memory_reserved_bytes is None
    assert (s.memory_used_bytes, s.memory_free_bytes) == (1536 * MIB, (81559 - 1536) * MIB)


def test_mig_samples_and_profiling_per_gpu_instance() -> None:
    fake = FakeNvml(a100_mig())
    backend = NvmlBackend(nvml=fake)
    gpu = backend.gpus()[0]
    fake.gpus[0].mig[0].used_mib = 4096  # type: ignore[index]
    fake.gpus[0].mig[1].gr_util_pct = 12.5  # type: ignore[index]
    backend.sample(gpu.uuid)
    fake.clock += 1
    s = backend.sample(gpu.uuid)
    assert s.gpu_util is None  # NVML has no utilisation for a MIG-enabled GPU
    assert [m.uuid for m in s.mig] == [m.uuid for m in gpu.mig_devices]
    assert [m.memory_used_bytes for m in s.mig] == [4096 * MIB, 0, 0]
    assert [m.memory_total_bytes for m in s.mig] == [40192 * MIB, 19968 * MIB, 9728 * MIB]
    assert [m.gr_engine_active for m in s.mig] == [0.4, 0.125, 0.4]
    assert len(fake.gpm_live) == 4  # one per GPU and one per GPU instance


def test_vgpu_licence_is_read_in_a_vgpu_guest_only() -> None:
    gpus = dgx_h100()[:2]
    gpus[0].virtualization, gpus[0].licensed = 2, True
    gpus[1].virtualization = 1  # passthrough
    backend = NvmlBackend(nvml=FakeNvml(gpus))
    a, b = backend.gpus()
    assert backend.sample(a.uuid).vgpu_license_status == 1
    assert backend.sample(b.uuid).vgpu_license_status is None


def test_processes_merge_compute_and_graphics_and_follow_mig_devices() -> None:
    gpus = dgx_h100()[:1] + a100_mig()[:1]
    gpus[0].processes = [(100, 2 * 2**30), (101, None)]
    gpus[0].graphics = [(100, 3 * 2**30), (102, 2**20)]
    assert gpus[1].mig is not None
    gpus[1].mig[0].processes = [(200, 2**30)]
    gpus[1].mig[2].processes = [(201, 2**29), (202, None)]
    backend = NvmlBackend(nvml=FakeNvml(gpus))
    whole, mig = backend.gpus()
    assert [(p.pid, p.used_memory_bytes, p.mig_uuid) for p in backend.processes(whole.uuid)] == [
        (100, 3 * 2**30, None),
        (101, None, None),
        (102, 2**20, None),
    ]
    m0, _, m2 = mig.mig_devices
    assert [(p.pid, p.mig_uuid, p.gpu_uuid) for p in backend.processes(mig.uuid)] == [
        (200, m0.uuid, mig.uuid),
        (201, m2.uuid, mig.uuid),
        (202, m2.uuid, mig.uuid),
    ]
    with pytest.raises(DeviceNotFound):
        backend.processes("GPU-unknown")


class OldDriverNvml(FakeNvml):
    """A driver without the v3 process calls: nvidia-ml-py refuses the unversioned ones."""

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        raise pynvml.NVMLLibraryMismatchError("Unversioned function called ...")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Any) -> list[Any]:
        return self._procs(h, "nvmlDeviceGetComputeRunningProcesses_v2", False)


def test_processes_fall_back_to_the_v2_call_on_an_older_driver() -> None:
    gpus = dgx_h100()[:1]
    gpus[0].processes = [(300, 2**30)]
    backend = NvmlBackend(nvml=OldDriverNvml(gpus))
    uuid = backend.gpus()[0].uuid
    assert [(p.pid, p.used_memory_bytes) for p in backend.processes(uuid)] == [(300, 2**30)]


# -- probe -------------------------------------------------------------------------------------


def test_probe_reads_health_state() -> None:
    fake = FakeNvml(dgx_h100()[:1] + t4_pair()[:1])
    backend = NvmlBackend(nvml=fake)
    h100, t4 = backend.gpus()
    p = backend.probe(h100.uuid)
    assert p.reachable and p.detail == ""
    assert (p.row_remap_pending, p.row_remap_failure, p.retired_pages_pending) == (True, False, None)
    assert (p.ecc_sbe_volatile, p.ecc_dbe_volatile) == (7, 1)
    p = backend.probe(t4.uuid)
    assert (p.row_remap_pending, p.retired_pages_pending) == (None, True)
    fake.gpus[0].lost = True
    lost = backend.probe(h100.uuid)
    assert not lost.reachable and "lost" in lost.detail
    with pytest.raises(DeviceNotFound):
        backend.probe("GPU-unknown")


def test_probe_answers_when_nvml_hangs(released: list[threading.Event]) -> None:
    fake = FakeNvml(dgx_h100()[:2])
    backend = NvmlBackend(nvml=fake, probe_timeout_s=0.05)
    stuck, fine = backend.gpus()
    hang = threading.Event()
    released.append(hang)
    fake.gpus[0].hang = hang
    first = backend.probe(stuck.uuid)
    assert not first.reachable and "did not answer within 0.05 s" in first.detail
    second = backend.probe(stuck.uuid)
    assert not second.reachable and "still waiting" in second.detail
    assert backend.probe(fine.uuid).reachable  # one hung GPU does not block the others
    fake.gpus[0].hang = None
    hang.set()
    deadline = time.monotonic() + 5
    while not (p := backend.probe(stuck.uuid)).reachable and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.reachable


# -- events ------------------------------------------------------------------------------------


def test_events_map_to_gpus_and_mig_devices() -> None:
    gpus = a100_mig() + t4_pair()[:1]
    gpus[2].events = 0  # this GPU cannot report events
    fake = FakeNvml(gpus)
    backend = NvmlBackend(nvml=fake)
    mig_gpu, whole, _ = backend.gpus()
    assert backend.wait_event(0.01) is None
    assert set(next(iter(fake.event_sets.values()))) == {0, 1}
    fake.emit(1, E.nvmlEventTypeXidCriticalError, 79)
    fake.emit(0, E.nvmlEventTypeXidCriticalError, 43, gi=3, ci=0)
    fake.emit(0, E.nvmlEventTypeDoubleBitEccError, 0, gi=9, ci=0xFFFFFFFF)
    fake.emit(1, E.nvmlEventTypeSingleBitEccError)
    events = [backend.wait_event(1) for _ in range(4)]
    assert [(e.kind, e.gpu_uuid, e.mig_uuid, e.xid) for e in events if e] == [
        (EventKind.XID, whole.uuid, None, 79),
        (EventKind.XID, mig_gpu.uuid, mig_gpu.mig_devices[1].uuid, 43),
        (EventKind.ECC_DBE, mig_gpu.uuid, mig_gpu.mig_devices[2].uuid, None),
        (EventKind.ECC_SBE, whole.uuid, None, None),
    ]
    assert backend.wait_event(0.01) is None


def test_a_hot_added_gpu_is_registered_for_events() -> None:
    fake = FakeNvml(dgx_h100()[:1])
    backend = NvmlBackend(nvml=fake)
    backend.gpus()
    assert backend.wait_event(0) is None
    fake.gpus.append(FakeGpu(uuid="GPU-new", bus_id="00000000:DB:00.0", minor=7))
    assert [g.uuid for g in backend.gpus()][-1] == "GPU-new"
    fake.emit(1, E.nvmlEventTypeXidCriticalError, 48)
    event = backend.wait_event(1)
    assert event is not None and (event.gpu_uuid, event.xid) == ("GPU-new", 48)


def test_an_event_from_a_lost_gpu_still_names_it() -> None:
    fake = FakeNvml(dgx_h100()[:2])
    backend = NvmlBackend(nvml=fake)
    gpus = backend.gpus()
    backend.wait_event(0)
    fake.gpus[1].lost = True
    fake.emit(1, E.nvmlEventTypeXidCriticalError, 79)
    event = backend.wait_event(1)
    assert event is not None and (event.gpu_uuid, event.xid) == (gpus[1].uuid, 79)


def test_gpm_samples_of_a_gpu_that_left_are_freed() -> None:
    fake = FakeNvml(dgx_h100()[:2])
    backend = NvmlBackend(nvml=fake)
    for gpu in backend.gpus():
        backend.sample(gpu.uuid)
    assert len(fake.gpm_live) == 2
    fake.gpus.pop()
    backend.gpus()
    assert len(fake.gpm_live) == 1


def test_close_releases_everything_nvml_gave() -> None:
    fake = FakeNvml(a100_mig())
    backend = NvmlBackend(nvml=fake)
    uuid = backend.gpus()[0].uuid
    backend.sample(uuid)
    backend.wait_event(0)
    assert fake.gpm_live and fake.event_sets
    backend.close()
    assert fake.gpm_live == {} and fake.event_sets == {} and fake.shutdown
    backend.close()
    assert backend.wait_event(1) is None


# -- backend selection ---------------------------------------------------------------------------


def test_auto_picks_nvml_when_it_sees_gpus() -> None:
    backend = detect_backend("auto", nvml=FakeNvml(dgx_h100()))
    assert isinstance(backend, NvmlBackend) and len(backend.gpus()) == 8


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        (FakeNvml([], init_error=E.NVML_ERROR_LIBRARY_NOT_FOUND), "found no GPU backend: the NVML library"),
        (FakeNvml([], init_error=E.NVML_ERROR_DRIVER_NOT_LOADED), "kernel driver is not loaded"),
        (FakeNvml([]), "NVML loaded (driver 550.90.07) but reports no GPU"),
    ],
    ids=["library-missing", "driver-not-loaded", "no-gpu"],
)
def test_auto_never_simulates_and_says_why(fake: FakeNvml, message: str) -> None:
    with pytest.raises(BackendUnavailable) as err:
        detect_backend("auto", nvml=fake)
    assert message in str(err.value)
    assert "--backend sim" in err.value.hint
    if fake.init_error is None:
        assert fake.shutdown  # the NVML session it opened is closed again


def test_auto_on_this_machine_uses_nvml_or_says_plainly_why_not() -> None:
    try:
        backend = detect_backend("auto")
    except BackendUnavailable as e:
        assert str(e).startswith("--backend auto")
        assert "--backend sim" in e.hint
        return
    try:
        assert isinstance(backend, NvmlBackend) and backend.gpus()
    finally:
        backend.close()


def test_explicit_kinds() -> None:
    sim = detect_backend("sim", "t4")
    assert isinstance(sim, SimBackend) and sim.name == "sim:t4"
    assert detect_backend("sim").name == "sim:dgx-h100"
    nvml = detect_backend("nvml", nvml=FakeNvml([]))
    assert isinstance(nvml, NvmlBackend) and nvml.gpus() == ()  # explicit nvml may start with no GPU yet
    with pytest.raises(ConfigError) as err:
        detect_backend("cuda")
    assert "expected one of auto, nvml, sim, got 'cuda'" in str(err.value)
