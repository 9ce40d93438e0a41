"""GPU health: detect XID/ECC faults and lost GPUs, mark exactly the affected devices, remediate, recover.

- `config`: the `gpunode.health` and `gpunode.remediation` sections (parse_health_config,
  parse_remediation_config, called by gpunode.config.agent).
- `xids`: the default XID policy table, with the reason for each code.
- `evidence`: health as a level recomputed from evidence (pure, explicit clock).
- `monitor`: HealthMonitor, the event handler and probe loop that publish health to DeviceState.
- `remediation` / `baremetal`: what happens to the work on a failed device (Kubernetes eviction,
  or signals / a hook command on bare metal).

This package never talks to NVML directly (it uses the Backend protocol) and never serves the
device-plugin API (DeviceState carries health to the device plugins).
"""

from gpunode.config.health import (
    BareMetalConfig,
    HealthConfig,
    RemediationConfig,
    XidPolicy,
    parse_health_config,
    parse_remediation_config,
)
from gpunode.node.health.model import Fault, HealthCounters, Remediator
from gpunode.node.health.monitor import HealthMonitor

__all__ = [
    "BareMetalConfig",
    "Fault",
    "HealthConfig",
    "HealthCounters",
    "HealthMonitor",
    "RemediationConfig",
    "Remediator",
    "XidPolicy",
    "parse_health_config",
    "parse_remediation_config",
]
