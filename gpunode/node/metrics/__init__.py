"""DCGM-compatible GPU metrics with per-pod values: the agent's Prometheus endpoint.

The package serves dcgm-exporter's default counter set with its names, types,
help, units and labels, so that existing dashboards and alerts keep working,
and adds what dcgm-exporter cannot give: per-container memory used and cap on
shared GPUs (from the interposer's regions), XID counts by code, device health,
device allocation by pod, and the agent's own collection metrics.

Parts, each in its own module (the `gpunode.metrics` section is parsed by gpunode.config.metrics):
  fields     the DCGM field table and unit conversions
  snapshot   one collection, frozen, with dcgm-exporter's labels
  render     snapshot -> Prometheus text
  collector  the background collector (MetricsCollector) and XID intake
  server     the HTTP endpoint (serve_metrics, MetricsServer)

Nothing here talks to NVML directly: values come from a devices.Backend.
"""

from gpunode.node.metrics.collector import HealthProvider, InventoryProvider, MetricsCollector
from gpunode.node.metrics.fields import FIELDS, DcgmField
from gpunode.node.metrics.server import MetricsServer, MetricsServerError, serve_metrics

__all__ = [
    "FIELDS",
    "DcgmField",
    "HealthProvider",
    "InventoryProvider",
    "MetricsCollector",
    "MetricsServer",
    "MetricsServerError",
    "serve_metrics",
]
