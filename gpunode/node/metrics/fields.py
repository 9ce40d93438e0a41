"""The dcgm-exporter default counter set: names, types, help, units, and where each value comes from.

Names, Prometheus types and help strings are those of dcgm-exporter 4.8's
etc/default-counters.csv, which users' dashboards and alerts are written
against; the units are DCGM's (MHz, C, W, mJ, %, MiB, MB/s, bytes/s, ratio).
Each field converts one value of a GpuSample (base units) into DCGM's unit, or
gives None when the backend could not read it, so the series is left out. This
module holds data and pure conversions only; it reads no backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpunode.contract.names import MIB
from gpunode.node.devices.base import GpuSample, MigSample

Number = int | float


@dataclass(frozen=True)
class DcgmField:
    """One exported DCGM field.

    gpu_value maps (sample, previous sample of the same GPU or None) to the
    value in DCGM's unit; mig_value does the same for a MIG instance. None
    from either means "not available": no series.
    """

    name: str
    prom_type: str  # "gauge" or "counter", as dcgm-exporter declares it
    help: str
    unit: str  # DCGM's unit of the value, for documentation and tests
    source: str  # the NVML call the backend reads it with
    integer: bool  # DCGM stores the field as an int64 (rendered %d) rather than a double (%f)
    gpu_value: Callable[[GpuSample, GpuSample | None], Number | None] | None = None
    mig_value: Callable[[MigSample], Number | None] | None = None


def _scaled(value: float | None, factor: float) -> int | None:
    return None if value is None else round(value * factor)


def _mib(value: int | None) -> int | None:
    return None if value is None else value // MIB


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _nvlink_rate_mb_s(s: GpuSample, prev: GpuSample | None) -> float | None:
    """NVLink throughput in MB/s, from the cumulative byte counter of two successive samples."""
    if prev is None or s.nvlink_bandwidth_total_bytes is None or prev.nvlink_bandwidth_total_bytes is None:
        return None
    elapsed_s = s.timestamp - prev.timestamp
    delta = s.nvlink_bandwidth_total_bytes - prev.nvlink_bandwidth_total_bytes
    if elapsed_s <= 0 or delta < 0:  # clock step or counter reset: no honest rate for this interval
        return None
    return delta / elapsed_s / 1e6


def _mig_free_mib(m: MigSample) -> int | None:
    if m.memory_total_bytes is None or m.memory_used_bytes is None:
        return None
    return max(m.memory_total_bytes - m.memory_used_bytes, 0) // MIB


XID_FIELD_NAME = "DCGM_FI_DEV_XID_ERRORS"

FIELDS: tuple[DcgmField, ...] = (
    DcgmField("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", "MHz",
              "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)", True,
              lambda s, _: _scaled(s.sm_clock_hz, 1e-6)),
    DcgmField("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", "MHz",
              "nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)", True,
              lambda s, _: _scaled(s.mem_clock_hz, 1e-6)),
    DcgmField("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", "C",
              "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)", True,
              lambda s, _: _scaled(s.memory_temp_c, 1)),
    DcgmField("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", "C",
              "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)", True,
              lambda s, _: _scaled(s.gpu_temp_c, 1)),
    DcgmField("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", "W",
              "nvmlDeviceGetPowerUsage (mW)", False,
              lambda s, _: s.power_w),
    DcgmField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).",
              "mJ", "nvmlDeviceGetTotalEnergyConsumption (mJ)", True,
              lambda s, _: _scaled(s.total_energy_j, 1e3)),
    DcgmField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", "1",
              "nvmlDeviceGetPcieReplayCounter", True,
              lambda s, _: s.pcie_replay_count),
    DcgmField("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", "%",
              "nvmlDeviceGetUtilizationRates().gpu", True,
              lambda s, _: _scaled(s.gpu_util, 100)),
    DcgmField("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", "%",
              "nvmlDeviceGetUtilizationRates().memory", True,
              lambda s, _: _scaled(s.mem_copy_util, 100)),
    DcgmField("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", "%",
              "nvmlDeviceGetEncoderUtilization", True,
              lambda s, _: _scaled(s.enc_util, 100)),
    DcgmField("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", "%",
              "nvmlDeviceGetDecoderUtilization", True,
              lambda s, _: _scaled(s.dec_util, 100)),
    # The value comes from the agent's event stream (nvmlEventSetWait, XID critical
    # errors), not from a sample: see MetricsCollector.record_event.
    DcgmField(XID_FIELD_NAME, "gauge", "Value of the last XID error encountered.", "XID code",
              "nvmlEventSetWait(nvmlEventTypeXidCriticalError)", True),
    DcgmField("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", "MiB",
              "nvmlDeviceGetMemoryInfo_v2().free; MIG: total - used of the MIG handle", True,
              lambda s, _: _mib(s.memory_free_bytes), _mig_free_mib),
    DcgmField("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", "MiB",
              "nvmlDeviceGetMemoryInfo_v2().used; MIG: of the MIG handle", True,
              lambda s, _: _mib(s.memory_used_bytes), lambda m: _mib(m.memory_used_bytes)),
    DcgmField("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", "MiB",
              "nvmlDeviceGetMemoryInfo_v2().reserved", True,
              lambda s, _: _mib(s.memory_reserved_bytes)),
    DcgmField("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "gauge",
              "Total number of NVLink bandwidth counters for all lanes.", "MB/s",
              "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX + _RX, all links: rate between two samples", False,
              _nvlink_rate_mb_s),
    DcgmField("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status", "enum",
              "nvmlDeviceGetGridLicensableFeatures (vGPU guests only)", True,
              lambda s, _: s.vgpu_license_status),
    DcgmField("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for uncorrectable errors", "rows",
              "nvmlDeviceGetRemappedRows().uncorrRows", True,
              lambda s, _: s.remapped_rows_uncorrectable),
    DcgmField("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
              "Number of remapped rows for correctable errors", "rows",
              "nvmlDeviceGetRemappedRows().corrRows", True,
              lambda s, _: s.remapped_rows_correctable),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", "0/1",
              "nvmlDeviceGetRemappedRows().isFailure", True,
              lambda s, _: _flag(s.row_remap_failure)),
    DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.", "ratio",
              "GPM NVML_GPM_METRIC_GRAPHICS_UTIL; MIG: nvmlGpmMigSampleGet", False,
              lambda s, _: s.gr_engine_active, lambda m: m.gr_engine_active),
    DcgmField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.",
              "ratio", "GPM NVML_GPM_METRIC_ANY_TENSOR_UTIL", False,
              lambda s, _: s.tensor_active),
    DcgmField("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
              "Ratio of cycles the device memory interface is active sending or receiving data.", "ratio",
              "GPM NVML_GPM_METRIC_DRAM_BW_UTIL", False,
              lambda s, _: s.dram_active),
    DcgmField("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge",
              "The rate of data transmitted over the PCIe bus - including both protocol headers and data "
              "payloads - in bytes per second.", "bytes/s",
              "GPM NVML_GPM_METRIC_PCIE_TX_PER_SEC", True,
              lambda s, _: _scaled(s.pcie_tx_bytes_per_s, 1)),
    DcgmField("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge",
              "The rate of data received over the PCIe bus - including both protocol headers and data "
              "payloads - in bytes per second.", "bytes/s",
              "GPM NVML_GPM_METRIC_PCIE_RX_PER_SEC", True,
              lambda s, _: _scaled(s.pcie_rx_bytes_per_s, 1)),
)  # fmt: skip

FIELDS_BY_NAME = {f.name: f for f in FIELDS}


def format_value(value: Number, *, integer: bool) -> str:
    """Render a value as DCGM does: int64 fields as %d, double fields as %f."""
    return str(int(value)) if integer else f"{float(value):f}"
