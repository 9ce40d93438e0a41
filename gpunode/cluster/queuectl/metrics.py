"""The queue controller's own metrics for Prometheus (prometheus_client, served on gpunode.infra.http).

Per queue: jobs pending and admitted, GPUs used against the guarantee and the fair
share, the fair-share usage memory (decayed GPU-seconds), the wait from the pods' creation to
admission (histogram), preemptions by reason; and the controller's leadership, Scheduler
rebuilds, refused configurations and the saves and loads of the usage memory (usagestore.py).
The gauges are read from the controller at scrape time (on the controller's loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gpunode.cluster.queueing.fairshare import roll_up
from gpunode.cluster.queueing.model import GPU
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.infra.http import HttpServer

if TYPE_CHECKING:
    from gpunode.cluster.queuectl.core import QueueCore

WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400, float("inf"))


class _State(Collector):
    def __init__(self, core: Callable[[], QueueCore], leader: Callable[[], bool]) -> None:
        self._core, self._leader = core, leader

    def collect(self) -> Iterator[Metric]:
        core = self._core()
        leader = GaugeMetricFamily("gpunode_queue_leader", "1 while this controller replica leads")
        leader.add_metric([], 1.0 if self._leader() else 0.0)
        yield leader
        rebuilds = GaugeMetricFamily(
            "gpunode_queue_scheduler_rebuilds", "Schedulers built from the API server"
        )
        rebuilds.add_metric([], float(core.rebuilds))
        yield rebuilds
        labels = ["queue"]
        pending = GaugeMetricFamily("gpunode_queue_pending_jobs", "Jobs waiting for admission", labels=labels)
        admitted = GaugeMetricFamily(
            "gpunode_queue_admitted_jobs", "Jobs admitted and holding GPUs", labels=labels
        )
        used = GaugeMetricFamily(
            "gpunode_queue_gpus_used", "GPUs held by the queue's admitted jobs", labels=labels
        )
        guarantee = GaugeMetricFamily(
            "gpunode_queue_gpus_guarantee", "GPUs guaranteed to the queue", labels=labels
        )
        share = GaugeMetricFamily(
            "gpunode_queue_gpus_fair_share", "The queue's fair share of GPUs", labels=labels
        )
        counts = {q: [0, 0] for q in core.config.queues}
        for j in core.last_jobs.values():
            c = counts.get(j.queue)
            holds = j.admitted or j.name in core.written  # written, perhaps not yet seen through the watch
            if c is not None and not j.problem and (holds or j.complete):
                c[1 if holds else 0] += 1
        for w in core.last_workloads.values():  # Jobs and JobSets: admitted while marked and resumed
            c = counts.get(w.queue)
            if c is None or w.problem or w.finished:
                continue
            if (w.mark is not None and not w.suspended) or w.job_name in core.written:
                c[1] += 1
            elif w.job_name in core.waiting_since:
                c[0] += 1
        sched = core.sched
        held = sched.allocated_by_queue() if sched is not None else {}
        shares = sched.shares if sched is not None else {}
        for q, spec in core.config.queues.items():
            pending.add_metric([q], float(counts[q][0]))
            admitted.add_metric([q], float(counts[q][1]))
            used.add_metric([q], held.get(q, {}).get(GPU, 0) / MILLI_PER_GPU)
            guarantee.add_metric([q], spec.guarantee.get(GPU, 0) / MILLI_PER_GPU)
            if q in shares:
                share.add_metric([q], shares[q].get(GPU, 0) / MILLI_PER_GPU)
        usage = GaugeMetricFamily(
            "gpunode_queue_usage_gpu_seconds",
            "The queue's fair-share usage memory: GPU-seconds decayed by the half-life, within the window",
            labels=labels,
        )
        memory = sched.usage_memory() if sched is not None else None
        if memory is not None:
            rolled = roll_up(core.config, memory[0])
            for q in core.config.queues:
                usage.add_metric([q], rolled.get(q, {}).get(GPU, 0.0) / MILLI_PER_GPU)
        yield from (pending, admitted, used, guarantee, share, usage)


class QueueMetrics:
    """The registry, the counters the controller updates, and the /metrics handler."""

    def __init__(self, core: Callable[[], QueueCore], leader: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_State(core, leader))
        self.wait = Histogram(
            "gpunode_queue_wait_seconds",
            "Time from the creation of a job's pods to its admission",
            ["queue"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.preemptions = Counter(
            "gpunode_queue_preemptions",
            "Preemption notices given",
            ["queue", "reason"],
            registry=self.registry,
        )
        self.admissions = Counter(
            "gpunode_queue_admissions", "Jobs admitted", ["queue"], registry=self.registry
        )
        self.config_refused = Counter(
            "gpunode_queue_config_refused",
            "Queue configuration files refused on reload",
            registry=self.registry,
        )
        self.usage_saves = Counter(
            "gpunode_queue_usage_saves",
            "Saves of the fair-share usage to its ConfigMap, by outcome (saved, error)",
            ["outcome"],
            registry=self.registry,
        )
        self.usage_loads = Counter(
            "gpunode_queue_usage_loads",
            "Loads of the saved fair-share usage on taking the lead, by outcome "
            "(loaded, absent, discarded, refused, error)",
            ["outcome"],
            registry=self.registry,
        )
        self.api_errors = Counter(
            "gpunode_queue_api_errors",
            "Writes to the API server that failed",
            ["verb"],
            registry=self.registry,
        )
        self.gang_repairs = Counter(
            "gpunode_queue_gang_repairs",
            "Gangs found admitted part-way, by what was done: completed (the rest marked) or undone",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("completed", "undone"):
            self.gang_repairs.labels(outcome)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)

    async def handle(self, request: web.Request) -> web.Response:
        """GET /metrics (and /healthz)."""
        if request.path == "/healthz":
            return web.Response(text="ok\n")
        if request.path != "/metrics" or request.method != "GET":
            return web.Response(status=404, text="not found: try /metrics\n")
        return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def server(self, host: str | None, port: int) -> HttpServer:
        """The HTTP server of /metrics."""
        return HttpServer(
            self.handle, name="queue controller metrics", max_body_bytes=0, host=host, port=port
        )
