"""How NvmlBackend reads one GPU's telemetry: each GpuSample field from the NVML call that
gives the same quantity as the dcgm-exporter default field of the same meaning.

| GpuSample field                | dcgm-exporter field (DCGM_FI_...) | NVML call (conversion)                                  |
|--------------------------------|-----------------------------------|---------------------------------------------------------|
| sm_clock_hz                    | DEV_SM_CLOCK                      | nvmlDeviceGetClockInfo(NVML_CLOCK_SM) (MHz -> Hz)       |
| mem_clock_hz                   | DEV_MEM_CLOCK                     | nvmlDeviceGetClockInfo(NVML_CLOCK_MEM) (MHz -> Hz)      |
| gpu_temp_c                     | DEV_GPU_TEMP                      | nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)          |
| memory_temp_c                  | DEV_MEMORY_TEMP                   | field NVML_FI_DEV_MEMORY_TEMP                           |
| power_w                        | DEV_POWER_USAGE                   | nvmlDeviceGetPowerUsage (mW -> W)                       |
| total_energy_j                 | DEV_TOTAL_ENERGY_CONSUMPTION      | nvmlDeviceGetTotalEnergyConsumption (mJ -> J)           |
| pcie_replay_count              | DEV_PCIE_REPLAY_COUNTER           | nvmlDeviceGetPcieReplayCounter                          |
| gpu_util, mem_copy_util        | DEV_GPU_UTIL, DEV_MEM_COPY_UTIL   | nvmlDeviceGetUtilizationRates (% -> ratio)              |
| enc_util, dec_util             | DEV_ENC_UTIL, DEV_DEC_UTIL        | nvmlDeviceGetEncoder/DecoderUtilization (% -> ratio)    |
| memory_used/free/reserved      | DEV_FB_USED/FREE/RESERVED         | nvmlDeviceGetMemoryInfo_v2 (bytes; v1 has no reserved)  |
| nvlink_bandwidth_total_bytes   | DEV_NVLINK_BANDWIDTH_TOTAL        | fields NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX + _RX,      |
|                                |                                   | scope UINT_MAX = all links (KiB -> bytes)               |
| vgpu_license_status            | DEV_VGPU_LICENSE_STATUS           | nvmlDeviceGetGridLicensableFeatures, in a vGPU guest    |
|                                |                                   | only (1 = a feature is licensed, 0 = none)              |
| remapped_rows_*, row_remap_*   | DEV_CORRECTABLE/UNCORRECTABLE_    | nvmlDeviceGetRemappedRows                               |
|                                | REMAPPED_ROWS, DEV_ROW_REMAP_*    |                                                         |
| ecc_sbe/dbe_volatile           | DEV_ECC_SBE/DBE_VOL_TOTAL         | nvmlDeviceGetTotalEccErrors(CORRECTED/UNCORRECTED,      |
|                                |                                   | VOLATILE)                                               |
| gr_engine_active               | PROF_GR_ENGINE_ACTIVE             | GPM NVML_GPM_METRIC_GRAPHICS_UTIL (% -> ratio)          |
| tensor_active                  | PROF_PIPE_TENSOR_ACTIVE           | GPM NVML_GPM_METRIC_ANY_TENSOR_UTIL (% -> ratio)        |
| dram_active                    | PROF_DRAM_ACTIVE                  | GPM NVML_GPM_METRIC_DRAM_BW_UTIL (% -> ratio)           |
| pcie_tx/rx_bytes_per_s         | PROF_PCIE_TX/RX_BYTES             | GPM NVML_GPM_METRIC_PCIE_TX/RX_PER_SEC (MiB/s -> B/s)   |
| mig[].memory_used/total_bytes  | DEV_FB_USED/FREE on the MIG device| nvmlDeviceGetMemoryInfo on the MIG device handle        |
| mig[].gr_engine_active         | PROF_GR_ENGINE_ACTIVE (MIG)       | nvmlGpmMigSampleGet + GRAPHICS_UTIL (% -> ratio)        |

GPM metrics are rates between two samples: the previous GPM sample of each GPU
(and of each MIG GPU instance) is kept, so the first sample() after start
reports them as None and every later one covers the time since the previous
call. GPM exists on Hopper and later; elsewhere those fields are None.

This module never imports pynvml: it calls NVML through the NvmlQuery helper
(nvmlquery.py), which owns the error translation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpunode.contract.names import MIB
from gpunode.node.devices.base import GpuSample, MigDevice, MigSample

if TYPE_CHECKING:
    from gpunode.node.devices.nvml.query import NvmlQuery

KIB = 1024
UINT_MAX = 0xFFFFFFFF

FI_DEV_MEMORY_TEMP = 82
FI_DEV_NVLINK_THROUGHPUT_RAW_TX = 140
FI_DEV_NVLINK_THROUGHPUT_RAW_RX = 141

GPM_GRAPHICS_UTIL = 1
GPM_ANY_TENSOR_UTIL = 5
GPM_DRAM_BW_UTIL = 10
GPM_PCIE_TX_PER_SEC = 20
GPM_PCIE_RX_PER_SEC = 21
GPM_GPU_METRICS = (
    GPM_GRAPHICS_UTIL,
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_PCIE_TX_PER_SEC,
    GPM_PCIE_RX_PER_SEC,
)
GPM_MIG_METRICS = (GPM_GRAPHICS_UTIL,)

_CLOCK_SM = 1
_CLOCK_MEM = 2
_TEMPERATURE_GPU = 0
_VGPU_GUEST = 2  # NVML_GPU_VIRTUALIZATION_MODE_VGPU


class GpmState:
    """The previous GPM sample of each GPU and MIG GPU instance, so that rates can be computed."""

    def __init__(self, q: NvmlQuery) -> None:
        self._q = q
        self._lock = threading.Lock()
        self._prev: dict[tuple[str, int | None], Any] = {}
        self._supported: dict[str, bool] = {}

    def metrics(
        self, handle: Any, uuid: str, metric_ids: Sequence[int], gi_id: int | None = None
    ) -> dict[int, float]:
        """GPM metric values over the time since the previous call for this GPU (or GPU instance)."""
        q = self._q
        with self._lock:
            if uuid not in self._supported:
                support = q.call("nvmlGpmQueryDeviceSupport", handle, uuid=uuid)
                self._supported[uuid] = bool(support is not None and support.isSupportedDevice)
            if not self._supported[uuid]:
                return {}
            sample = q.call("nvmlGpmSampleAlloc", uuid=uuid)
            if sample is None:
                return {}
            try:
                if gi_id is None:
                    taken = q.call("nvmlGpmSampleGet", handle, sample, uuid=uuid)
                else:
                    taken = q.call("nvmlGpmMigSampleGet", handle, gi_id, sample, uuid=uuid)
            except BaseException:
                q.call("nvmlGpmSampleFree", sample)
                raise
            if taken is None:
                q.call("nvmlGpmSampleFree", sample)
                return {}
            key = (uuid, gi_id)
            prev = self._prev.get(key)
            self._prev[key] = sample
            if prev is None:
                return {}
            try:
                return self._compute(prev, sample, metric_ids, uuid)
            finally:
                q.call("nvmlGpmSampleFree", prev)

    def _compute(self, prev: Any, sample: Any, metric_ids: Sequence[int], uuid: str) -> dict[int, float]:
        q = self._q
        request = q.nv.c_nvmlGpmMetricsGet_t()
        request.version = q.const("NVML_GPM_METRICS_GET_VERSION", 1)
        request.numMetrics = len(metric_ids)
        request.sample1 = prev
        request.sample2 = sample
        for i, metric in enumerate(metric_ids):
            request.metrics[i].metricId = metric
        answer = q.call("nvmlGpmMetricsGet", request, uuid=uuid)
        if answer is None:
            return {}
        return {
            int(m.metricId): float(m.value)
            for m in list(answer.metrics)[: len(metric_ids)]
            if int(m.nvmlReturn) == 0
        }

    def retain(self, uuids: set[str]) -> None:
        """Free the samples of GPUs that are gone."""
        with self._lock:
            for key in [k for k in self._prev if k[0] not in uuids]:
                self._q.call("nvmlGpmSampleFree", self._prev.pop(key))
            for uuid in [u for u in self._supported if u not in uuids]:
                del self._supported[uuid]

    def free_all(self) -> None:
        """Free every held GPM sample (the backend closes)."""
        with self._lock:
            for sample in self._prev.values():
                self._q.call("nvmlGpmSampleFree", sample)
            self._prev.clear()


def read_sample(
    q: NvmlQuery,
    handle: Any,
    uuid: str,
    migs: Sequence[tuple[Any, MigDevice]],
    gpm: GpmState,
) -> GpuSample:
    """Read every GpuSample field of one GPU (see the table above). Raises GpuLostError for a lost GPU."""
    timestamp = time.time()

    def call(fn: str, *args: Any, **kw: Any) -> Any:
        return q.call(fn, handle, *args, uuid=uuid, **kw)

    sm_clock = call("nvmlDeviceGetClockInfo", _CLOCK_SM)
    mem_clock = call("nvmlDeviceGetClockInfo", _CLOCK_MEM)
    memory_temp, nvlink_tx, nvlink_rx = q.field_values(
        handle,
        [
            FI_DEV_MEMORY_TEMP,
            (FI_DEV_NVLINK_THROUGHPUT_RAW_TX, UINT_MAX),
            (FI_DEV_NVLINK_THROUGHPUT_RAW_RX, UINT_MAX),
        ],
        uuid=uuid,
    )
    power_mw = call("nvmlDeviceGetPowerUsage")
    energy_mj = call("nvmlDeviceGetTotalEnergyConsumption")
    util = call("nvmlDeviceGetUtilizationRates")
    enc = call("nvmlDeviceGetEncoderUtilization")
    dec = call("nvmlDeviceGetDecoderUtilization")
    used, free, reserved = _memory(q, handle, uuid)
    remap = call("nvmlDeviceGetRemappedRows")
    sbe = call("nvmlDeviceGetTotalEccErrors", 0, 0)  # corrected, volatile
    dbe = call("nvmlDeviceGetTotalEccErrors", 1, 0)  # uncorrected, volatile
    prof = gpm.metrics(handle, uuid, GPM_GPU_METRICS)
    return GpuSample(
        uuid=uuid,
        timestamp=timestamp,
        sm_clock_hz=sm_clock * 1e6 if sm_clock is not None else None,
        mem_clock_hz=mem_clock * 1e6 if mem_clock is not None else None,
        gpu_temp_c=_float(call("nvmlDeviceGetTemperature", _TEMPERATURE_GPU)),
        memory_temp_c=_float(memory_temp),
        power_w=power_mw / 1000.0 if power_mw is not None else None,
        total_energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
        pcie_replay_count=_int(call("nvmlDeviceGetPcieReplayCounter")),
        gpu_util=util.gpu / 100.0 if util is not None else None,
        mem_copy_util=util.memory / 100.0 if util is not None else None,
        enc_util=enc[0] / 100.0 if enc is not None else None,
        dec_util=dec[0] / 100.0 if dec is not None else None,
        memory_used_bytes=used,
        memory_free_bytes=free,
        memory_reserved_bytes=reserved,
        nvlink_bandwidth_total_bytes=(
            int(nvlink_tx + nvlink_rx) * KIB if nvlink_tx is not None and nvlink_rx is not None else None
        ),
        vgpu_license_status=_vgpu_license(q, handle, uuid),
        remapped_rows_correctable=int(remap[0]) if remap is not None else None,
        remapped_rows_uncorrectable=int(remap[1]) if remap is not None else None,
        row_remap_pending=bool(remap[2]) if remap is not None else None,
        row_remap_failure=bool(remap[3]) if remap is not None else None,
        ecc_sbe_volatile=_int(sbe),
        ecc_dbe_volatile=_int(dbe),
        gr_engine_active=_ratio(prof.get(GPM_GRAPHICS_UTIL)),
        tensor_active=_ratio(prof.get(GPM_ANY_TENSOR_UTIL)),
        dram_active=_ratio(prof.get(GPM_DRAM_BW_UTIL)),
        pcie_tx_bytes_per_s=_mib_rate(prof.get(GPM_PCIE_TX_PER_SEC)),
        pcie_rx_bytes_per_s=_mib_rate(prof.get(GPM_PCIE_RX_PER_SEC)),
        mig=tuple(_mig_sample(q, handle, uuid, mh, mig, gpm) for mh, mig in migs),
    )


def _memory(q: NvmlQuery, handle: Any, uuid: str) -> tuple[int | None, int | None, int | None]:
    version = q.const("nvmlMemory_v2", None)
    if version is not None:
        info = q.call("nvmlDeviceGetMemoryInfo", handle, uuid=uuid, version=version)
        if info is not None:
            return int(info.used), int(info.free), int(info.reserved)
    info = q.call("nvmlDeviceGetMemoryInfo", handle, uuid=uuid)
    if info is None:
        return None, None, None
    return int(info.used), int(info.free), None


def _vgpu_license(q: NvmlQuery, handle: Any, uuid: str) -> int | None:
    if q.call("nvmlDeviceGetVirtualizationMode", handle, uuid=uuid) != _VGPU_GUEST:
        return None  # bare metal or passthrough: there is no vGPU licence to report
    features = q.call("nvmlDeviceGetGridLicensableFeatures", handle, uuid=uuid)
    if features is None or not features.isGridLicenseSupported:
        return None
    count = int(features.licensableFeaturesCount)
    return int(any(f.featureState for f in list(features.gridLicensableFeatures)[:count]))


def _mig_sample(q: NvmlQuery, parent: Any, uuid: str, mh: Any, mig: MigDevice, gpm: GpmState) -> MigSample:
    info = q.call("nvmlDeviceGetMemoryInfo", mh, uuid=uuid)
    prof = gpm.metrics(parent, uuid, GPM_MIG_METRICS, gi_id=mig.gi_id)
    return MigSample(
        uuid=mig.uuid,
        memory_used_bytes=int(info.used) if info is not None else None,
        memory_total_bytes=int(info.total) if info is not None else mig.memory_total_bytes,
        gr_engine_active=_ratio(prof.get(GPM_GRAPHICS_UTIL)),
    )


def _float(value: Any) -> float | None:
    return float(value) if value is not None else None


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _ratio(percent: float | None) -> float | None:
    return None if percent is None else min(1.0, max(0.0, percent / 100.0))


def _mib_rate(mib_per_s: float | None) -> float | None:
    return None if mib_per_s is None else mib_per_s * MIB
