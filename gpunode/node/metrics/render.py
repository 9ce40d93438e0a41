"""Turn a NodeSnapshot into Prometheus text exposition (format 0.0.4).

Two parts, one body. The dcgm-exporter families are printed here, by hand,
because their names must stay exactly as dcgm-exporter prints them (counters
such as DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION carry no `_total`, which
prometheus-client would append). gpunode's own families (per-container memory,
XID counts by code, device health and allocation, sample times) are built as
prometheus-client metric families and printed by its exposition code.

Rendering is pure: it reads the snapshot and the XID state it is given, never a
backend or a socket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gpunode.contract.names import MILLI_PER_GPU
from gpunode.node.metrics.fields import FIELDS, XID_FIELD_NAME, format_value
from gpunode.node.metrics.snapshot import EntityKey, NodeSnapshot, owner_labels, render_labels


@dataclass(frozen=True)
class XidState:
    """XID errors seen since the agent started: the last code and a count per code, per device.

    A device is a GPU (MIG UUID None) or a MIG instance; an XID on a MIG
    instance also counts as the parent GPU's last XID. unknown_device counts
    XIDs the driver could not tie to a GPU.
    """

    last: Mapping[EntityKey, int] = field(default_factory=dict)
    counts: Mapping[tuple[EntityKey, int], int] = field(default_factory=dict)
    unknown_device: Mapping[int, int] = field(default_factory=dict)
    base_pairs: Mapping[EntityKey, tuple[tuple[str, str], ...]] = field(
        default_factory=dict
    )  # of devices gone


def render_dcgm(snapshot: NodeSnapshot, xid: XidState) -> str:
    """The dcgm-exporter families, in default-counters.csv order; a family without series is left out."""
    out: list[str] = []
    for f in FIELDS:
        lines: list[str] = []
        if f.name == XID_FIELD_NAME:
            # DCGM reports 0 until an XID occurs; the agent watches the driver's events from its start.
            for e in snapshot.entities:
                lines.append(f"{f.name}{{{e.labels}}} {format_value(xid.last.get(e.key, 0), integer=True)}")
        else:
            for e in snapshot.entities:
                v = e.values.get(f.name)
                if v is not None:
                    lines.append(f"{f.name}{{{e.labels}}} {v}")
        if lines:
            out.append(f"# HELP {f.name} {f.help}")
            out.append(f"# TYPE {f.name} {f.prom_type}")
            out.extend(lines)
    return "\n".join(out) + "\n" if out else ""


# The device labels gpunode's XID counter keeps: stable identity, snake_case where it is ours.
_XID_LABELS = frozenset({"gpu", "UUID", "device", "GPU_I_PROFILE", "GPU_I_ID"})


class _GpunodeFamilies(Collector):
    """gpunode's own per-device families of one snapshot, for prometheus-client's exposition."""

    def __init__(self, snapshot: NodeSnapshot, xid: XidState, hostname_label: str, hostname: str) -> None:
        self._snap = snapshot
        self._xid = xid
        self._host = (hostname_label, hostname)

    def collect(self) -> Iterator[Metric]:
        yield from self._container_memory()
        yield from self._xid_counts()
        yield from self._devices()
        yield from self._sample_times()

    def _container_memory(self) -> Iterable[Metric]:
        if not self._snap.containers:
            return
        used = Metric(
            "gpunode_container_memory_used_bytes",
            "GPU memory charged to one container on one device in its memory-cap region (what counts against "
            "its cap).",
            "gauge",
        )
        limit = Metric(
            "gpunode_container_memory_limit_bytes",
            "GPU memory cap of one container on one device, from its memory-cap region.",
            "gauge",
        )
        share = Metric(
            "gpunode_container_compute_share",
            "Compute share of one container (fraction of the GPU), as the agent wrote it into its region.",
            "gauge",
        )
        achieved = Metric(
            "gpunode_container_compute_achieved_share",
            "GPU time of one container's work over wall time in the last 10 s, as its interposer reported it "
            "(the container can write its region: compare with the driver's per-process figures).",
            "gauge",
        )
        busy = Metric(
            "gpunode_container_compute_busy_seconds",
            "GPU time of one container's work, as its interposer reported it.",
            "counter",
        )
        throttled = Metric(
            "gpunode_container_compute_throttled_seconds",
            "Time one container's kernel launches were held back to keep it to its compute share.",
            "counter",
        )
        for c in self._snap.containers:
            labels = {"UUID": c.gpu_uuid, "region": c.region, self._host[0]: self._host[1]}
            if c.gpu_index is not None:
                labels["gpu"] = str(c.gpu_index)
            if c.mig is not None:
                labels.update(GPU_I_PROFILE=c.mig.profile, GPU_I_ID=str(c.mig.gi_id))
            if c.owner is not None:
                labels.update(
                    resource=c.owner.resource_name,
                    namespace=c.owner.namespace,
                    pod=c.owner.pod,
                    container=c.owner.container,
                )
            elif c.claim is not None:  # a DRA claim's share: the claim, and its pod when it is one
                labels.update(c.claim.labels())
            used.add_sample(used.name, labels, c.used_bytes)
            limit.add_sample(limit.name, labels, c.limit_bytes)
            if c.compute is not None:
                if c.compute.share_milli:
                    share.add_sample(share.name, labels, c.compute.share_milli / MILLI_PER_GPU)
                if c.compute.achieved_share is not None:
                    achieved.add_sample(achieved.name, labels, round(c.compute.achieved_share, 6))
                busy.add_sample(busy.name + "_total", labels, c.compute.busy_s)
                throttled.add_sample(throttled.name + "_total", labels, c.compute.throttled_s)
        yield used
        yield limit
        for family in (share, achieved, busy, throttled):
            if family.samples:
                yield family

    def _xid_counts(self) -> Iterable[Metric]:
        if not self._xid.counts and not self._xid.unknown_device:
            return
        m = Metric(
            "gpunode_xid_errors",
            "XID errors seen since the agent started, by device and XID code.",
            "counter",
        )
        for (key, code), n in sorted(
            self._xid.counts.items(), key=lambda kv: (kv[0][0][0], kv[0][0][1] or "", kv[0][1])
        ):
            entity = self._snap.entity(key)
            pairs = entity.base_pairs if entity is not None else self._xid.base_pairs.get(key)
            labels = {k: v for k, v in pairs or () if k in _XID_LABELS} or {"UUID": key[0]}
            labels[self._host[0]] = self._host[1]
            labels["code"] = str(code)
            m.add_sample("gpunode_xid_errors_total", labels, n)
        for code, n in sorted(self._xid.unknown_device.items()):
            m.add_sample("gpunode_xid_errors_total", {self._host[0]: self._host[1], "code": str(code)}, n)
        yield m

    def _devices(self) -> Iterable[Metric]:
        if not self._snap.devices:
            return
        healthy = Metric(
            "gpunode_device_healthy",
            "1 when the advertised device is healthy, 0 when the agent reports it unhealthy to the kubelet.",
            "gauge",
        )
        allocated = Metric(
            "gpunode_device_allocated",
            "1 when the kubelet lists the device for a container (with its pod), 0 when it is free.",
            "gauge",
        )
        for d in self._snap.devices:
            labels = {"resource": d.resource, "device_id": d.device_id, "UUID": d.gpu_uuid}
            if d.gpu_index is not None:
                labels["gpu"] = str(d.gpu_index)
            labels[self._host[0]] = self._host[1]
            healthy.add_sample(healthy.name, labels, 1 if d.healthy else 0)
            if d.owner is not None:
                labels = {**labels, **dict(owner_labels(d.owner))}
            allocated.add_sample(allocated.name, labels, 1 if d.owner is not None else 0)
        yield healthy
        yield allocated

    def _sample_times(self) -> Iterable[Metric]:
        if not self._snap.sample_times:
            return
        m = Metric(
            "gpunode_gpu_last_sample_timestamp_seconds",
            "When the GPU's telemetry was last read successfully (seconds since the epoch).",
            "gauge",
        )
        for t in self._snap.sample_times:
            labels = {"gpu": str(t.gpu_index), "UUID": t.uuid, self._host[0]: self._host[1]}
            m.add_sample(m.name, labels, t.timestamp_s)
        yield m


def render_gpunode(snapshot: NodeSnapshot, xid: XidState, *, hostname_label: str, hostname: str) -> bytes:
    """gpunode's per-device families of one snapshot, through prometheus-client's exposition."""
    return generate_latest(_GpunodeFamilies(snapshot, xid, hostname_label, hostname))


def render_body(snapshot: NodeSnapshot, xid: XidState, *, hostname_label: str, hostname: str) -> bytes:
    """Everything about the devices that one snapshot says, ready to be served."""
    return render_dcgm(snapshot, xid).encode() + render_gpunode(
        snapshot, xid, hostname_label=hostname_label, hostname=hostname
    )


__all__ = ["XidState", "render_body", "render_dcgm", "render_gpunode", "render_labels"]
