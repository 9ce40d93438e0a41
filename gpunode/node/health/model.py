"""The records that cross from health detection to remediation and metrics.

A Fault is what detection hands to a remediator when a GPU or a MIG instance
turns unhealthy: which device, why, and which advertised device IDs it takes
down (so remediation can find the pods holding them without knowing the
inventory). HealthCounters is what the metrics read. The Remediator protocol
is the seam between the two halves. Plain frozen data: no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Fault kinds
XID, ECC_DBE, ECC_SBE, GPU_LOST, PROBE = "xid", "ecc_dbe", "ecc_sbe", "gpu_lost", "probe"


@dataclass(frozen=True)
class Fault:
    """One device (GPU or MIG instance) that just turned unhealthy."""

    target_uuid: str  # the GPU UUID, or the MIG UUID for a fault confined to one instance
    gpu_uuid: str  # the physical GPU
    mig_uuid: str | None
    kind: str  # XID | ECC_DBE | ECC_SBE | GPU_LOST | PROBE
    reason: str  # one sentence for logs and Events, e.g. "XID 79 (GPU has fallen off the bus): fatal"
    xid: int | None = None
    device_ids: tuple[str, ...] = ()  # advertised device IDs it takes down (all resources)
    detected_at: float = 0.0  # time.time() of the detection

    def describe(self) -> str:
        """For logs and Events: "GPU <uuid>: <reason>", or "MIG device <mig> of GPU <uuid>: <reason>"."""
        where = (
            f"MIG device {self.mig_uuid} of GPU {self.gpu_uuid}" if self.mig_uuid else f"GPU {self.gpu_uuid}"
        )
        return f"{where}: {self.reason}"


class Remediator(Protocol):
    """Acts on faults. notify() is called from any thread and must return at once."""

    def notify(self, unhealthy: Mapping[str, str], faults: Sequence[Fault]) -> None:
        """`unhealthy`: every GPU/MIG UUID unhealthy now, with its reason (a level); `faults`: new ones (edges)."""
        ...


@dataclass(frozen=True)
class HealthCounters:
    """Cumulative counts since the agent started, for the metrics."""

    xid_total: Mapping[tuple[str, int], int] = field(default_factory=dict)  # (GPU UUID, code) -> count
    ecc_sbe_events: Mapping[str, int] = field(default_factory=dict)  # GPU UUID -> errors reported by events
    ecc_dbe_events: Mapping[str, int] = field(default_factory=dict)
    gpu_lost_events: Mapping[str, int] = field(default_factory=dict)
    probe_failures: Mapping[str, int] = field(default_factory=dict)  # GPU UUID -> failed or hung probes
    probes: int = 0
    became_unhealthy: Mapping[str, int] = field(default_factory=dict)  # GPU/MIG UUID -> transitions
    recovered: Mapping[str, int] = field(default_factory=dict)
    unhealthy: Mapping[str, str] = field(default_factory=dict)  # now: GPU/MIG UUID -> reason
