"""Device backends: where gpunode learns what GPUs a node has and how they are doing.

`base` defines the Backend protocol and the frozen snapshots every other part
consumes; `nvml` is the real backend and `sim` a simulated node. Nothing outside
this package talks to NVML.
"""

from gpunode.node.devices.base import (
    Backend,
    DeviceEvent,
    EventKind,
    Gpu,
    GpuProbe,
    GpuProcess,
    GpuSample,
    MigDevice,
    MigSample,
)

__all__ = [
    "Backend",
    "DeviceEvent",
    "EventKind",
    "Gpu",
    "GpuProbe",
    "GpuProcess",
    "GpuSample",
    "MigDevice",
    "MigSample",
]
