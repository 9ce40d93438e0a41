"""The agent's own metrics about collection: durations, results, errors, ages and the process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OwnMetrics:
    """The agent's own metrics about collection, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "gpunode_metrics_collection_duration_seconds",
            "Time one background collection took (backend, memory-cap regions, rendering).",
            buckets=_DURATION_BUCKETS_S,
            registry=registry,
        )
        self.collections = Counter(
            "gpunode_metrics_collections",
            "Background collections by result: ok, partial (some GPU could not be read) or failed.",
            ["result"],
            registry=registry,
        )
        self.backend_errors = Counter(
            "gpunode_backend_errors",
            "Failed backend (NVML) calls during collection, by call and error.",
            ["call", "error"],
            registry=registry,
        )
        self.last_success = Gauge(
            "gpunode_metrics_last_success_timestamp_seconds",
            "When the last collection that read the node finished (seconds since the epoch).",
            registry=registry,
        )
        self.sample_age = Gauge(
            "gpunode_metrics_sample_age_seconds",
            "Age of the device values this scrape shows: now minus the time of the last good collection.",
            registry=registry,
        )
        self.attribution_errors = Counter(
            "gpunode_pod_attribution_errors",
            "Failed pod-resources List calls to the kubelet.",
            registry=registry,
        )
        self.attribution_age = Gauge(
            "gpunode_pod_attribution_age_seconds",
            "Age of the kubelet's device assignment used for pod labels.",
            registry=registry,
        )
        self.region_errors = Counter(
            "gpunode_memcap_region_errors",
            "Memory-cap regions that could not be read during collection.",
            registry=registry,
        )
        self.bad_regions = Gauge(
            "gpunode_memcap_bad_regions",
            "Memory-cap regions the agent skips because their files are unusable (1 each), by region key "
            "and reason: truncated, missing, corrupt, leased, limit or io.",
            ["region", "reason"],
            registry=registry,
        )
        # The agent process itself: resident memory, CPU seconds, open file descriptors.
        ProcessCollector(registry=registry)
        self.event_counts = Counter(
            "gpunode_metrics_device_events",
            "Device events the collector received from the agent, by kind.",
            ["kind"],
            registry=registry,
        )
