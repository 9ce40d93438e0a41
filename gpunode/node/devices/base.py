"""The Backend protocol and the frozen snapshots that cross its boundary.

Everything here is plain data in base units: bytes, seconds, watts, joules,
celsius, hertz, and ratios in 0..1. A value the hardware or driver cannot give
is None, never a made-up number. This module must not import NVML or any
backend; backends import it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a GPU instance with one compute instance) on a parent GPU."""

    uuid: str  # "MIG-<uuid>"
    parent_uuid: str
    index: int  # MIG device index on the parent (nvmlDeviceGetMigDeviceHandleByIndex)
    profile: str  # "1g.10gb", "3g.40gb", ...
    gi_id: int  # GPU instance ID
    ci_id: int  # compute instance ID
    slices: int  # GPU slices the instance occupies (1..7)
    memory_total_bytes: int
    start: int | None = None  # first memory slice of its placement (0..7); None where not known


@dataclass(frozen=True)
class Gpu:
    """A physical GPU as discovered."""

    index: int  # NVML index
    uuid: str  # "GPU-<uuid>"
    model: str  # "NVIDIA H100 80GB HBM3"
    memory_total_bytes: int
    pci_bus_id: str  # "00000000:18:00.0"
    numa_node: int | None
    minor: int  # /dev/nvidia<minor>
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    nvlink_peers: tuple[str, ...] = ()  # UUIDs of GPUs with at least one active NVLink to this one
    architecture: str | None = None  # "hopper", "ampere", "turing", ...

    def mig_by_uuid(self, uuid: str) -> MigDevice | None:
        """The MIG device with this UUID on this GPU, or None."""
        return next((m for m in self.mig_devices if m.uuid == uuid), None)


@dataclass(frozen=True)
class MigSample:
    """Telemetry of one MIG device."""

    uuid: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    gr_engine_active: float | None = None  # ratio 0..1


@dataclass(frozen=True)
class GpuSample:
    """Telemetry of one physical GPU at one instant. None = not available on this GPU/driver."""

    uuid: str
    timestamp: float = field(default_factory=time.time)  # seconds since the epoch
    sm_clock_hz: float | None = None
    mem_clock_hz: float | None = None
    gpu_temp_c: float | None = None
    memory_temp_c: float | None = None
    power_w: float | None = None
    total_energy_j: float | None = None  # since driver load
    pcie_replay_count: int | None = None
    gpu_util: float | None = None  # ratio 0..1
    mem_copy_util: float | None = None
    enc_util: float | None = None
    dec_util: float | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    nvlink_bandwidth_total_bytes: int | None = None  # counter, all links, both directions
    vgpu_license_status: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    # Profiling (GPM) fields; None where GPM is not supported.
    gr_engine_active: float | None = None  # ratio 0..1
    tensor_active: float | None = None  # ratio 0..1
    dram_active: float | None = None  # ratio 0..1
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    mig: tuple[MigSample, ...] = ()


@dataclass(frozen=True)
class GpuProbe:
    """The result of a health probe of one GPU. reachable=False means lost/off the bus."""

    uuid: str
    reachable: bool
    detail: str = ""
    retired_pages_pending: bool | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    # Total energy since the driver loaded: it only grows while the GPU is up and starts again from zero when
    # the GPU is reset or the driver reloaded, so (with the volatile ECC counts) it shows that a reset happened.
    energy_j: float | None = None
    duration_s: float = 0.0


@dataclass(frozen=True)
class GpuProcess:
    """A process with a CUDA context on a GPU (or on one of its MIG devices)."""

    pid: int
    gpu_uuid: str
    used_memory_bytes: int | None
    mig_uuid: str | None = None


@dataclass(frozen=True)
class ProcessUtilization:
    """One per-process utilisation sample, as NVML's nvmlDeviceGetProcessUtilization gives it: the share
    of the sample's period the process's kernels ran on the GPU's SMs. Under time-slicing it is the time
    the process got, not the time it asked for (a process sharing the GPU with another reads lower)."""

    pid: int
    timestamp_us: int  # when the sample was taken, microseconds since the epoch
    sm_percent: int  # 0..100


class EventKind(enum.Enum):
    """What a DeviceEvent reports: an XID, an ECC error, or a GPU lost, removed or added."""

    XID = "xid"
    ECC_SBE = "ecc_sbe"  # single-bit (corrected) ECC error
    ECC_DBE = "ecc_dbe"  # double-bit (uncorrected) ECC error
    GPU_LOST = "gpu_lost"  # fell off the bus / stopped answering
    GPU_REMOVED = "gpu_removed"  # hot-unplug: gone from the bus
    GPU_ADDED = "gpu_added"  # hot-plug: a new GPU appeared


@dataclass(frozen=True)
class DeviceEvent:
    """A fault or topology event reported by the backend."""

    kind: EventKind
    gpu_uuid: str | None  # None when the driver could not say which GPU
    mig_uuid: str | None = None  # set when the event is known to concern one MIG device
    xid: int | None = None  # set for EventKind.XID
    count: int = 1  # number of errors the event stands for (ECC counts)
    timestamp: float = field(default_factory=time.time)


@runtime_checkable
class Backend(Protocol):
    """What gpunode needs from a GPU node. Implementations: NvmlBackend, SimBackend.

    All methods may be called from worker threads; implementations are thread safe.
    Query methods raise gpunode.errors.GpuLostError for a lost GPU,
    gpunode.errors.DeviceNotFound for an unknown UUID, and BackendError otherwise.
    """

    name: str  # "nvml" or "sim:<profile>"

    def driver_version(self) -> str | None:
        """The driver version as NVML reports it, e.g. "550.90.07"; None when it is not known."""
        ...

    def gpus(self) -> tuple[Gpu, ...]:
        """Discover the GPUs present now (a fresh snapshot each call), ordered by index."""
        ...

    def sample(self, uuid: str) -> GpuSample:
        """Read the telemetry of one GPU (and of its MIG devices)."""
        ...

    def processes(self, uuid: str) -> tuple[GpuProcess, ...]:
        """Processes with a context on the GPU or its MIG devices."""
        ...

    def probe(self, uuid: str) -> GpuProbe:
        """Health probe: answers even for a lost GPU (reachable=False), never raises for it."""
        ...

    def wait_event(self, timeout_s: float) -> DeviceEvent | None:
        """Block up to timeout_s for the next fault/topology event; None on timeout."""
        ...

    def close(self) -> None:
        """Release the backend; wait_event answers None afterwards. Calling it again does nothing."""
        ...


@runtime_checkable
class MigPartitioner(Protocol):
    """A backend that can create and destroy MIG instances (the DRA plugin's dynamic MIG partitioning).

    Implementations: NvmlBackend, SimBackend. Errors are gpunode errors: DeviceNotFound for an unknown
    GPU or MIG device, BackendError (one line naming the GPU and why) for everything else.
    """

    def create_mig(self, gpu_uuid: str, profile: str, start: int) -> str:
        """Create a GPU instance of `profile` whose memory slices start at `start`, with one compute
        instance over all its slices; the new MIG device's UUID ("MIG-..."). Nothing is left behind on
        failure. The next gpus() lists it."""
        ...

    def destroy_mig(self, mig_uuid: str) -> None:
        """Destroy a MIG device's compute instance and GPU instance (refused while a process uses it)."""
        ...
