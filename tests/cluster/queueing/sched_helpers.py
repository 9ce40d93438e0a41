"""Small clusters, queue configurations and jobs for the scheduling engine's hand-worked tests."""

from __future__ import annotations

from typing import Any

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.config import QueueConfig, parse_queue_config
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job
from gpunode.cluster.queueing.presets import preset
from gpunode.contract.names import GIB
from gpunode.placement.model import GpuState, NodeState, Request


def node(name: str, gpus: int = 8) -> NodeState:
    """An empty node of `gpus` 40 GiB A100s."""
    return NodeState(
        name=name,
        gpus=tuple(
            GpuState(
                uuid=f"{name}-g{j}",
                index=j,
                model="A100",
                milli_free=1000,
                memory_total_bytes=40 * GIB,
                memory_free_bytes=40 * GIB,
                numa_node=None,
            )
            for j in range(gpus)
        ),
        cpu_milli_free=128000,
        memory_free_bytes=1024 * GIB,
    )


def config(queues: list[dict[str, Any]], **extra: Any) -> QueueConfig:
    """A queue configuration; preemption defaults to notice 5m, minRuntime 0 unless given."""
    data: dict[str, Any] = {"queues": queues, "preemption": {"notice": "5m", "minRuntime": "0s"}}
    data.update(extra)
    return parse_queue_config(data, "test.yaml")


TWO_TEAMS = [{"name": "a", "guarantee": {"gpu": 8}}, {"name": "b", "guarantee": {"gpu": 8}}]


def scheduler(
    cfg: QueueConfig, nodes: int = 2, gpus: int = 8, policy: str = "gpunode", seed: int = 0
) -> Scheduler:
    """A Scheduler over `nodes` empty nodes, best-fit placement."""
    cap = ClusterCapacity([node(f"n{i}", gpus) for i in range(nodes)], policy="bestfit", seed=seed)
    return Scheduler(cfg, cap, preset(policy))


def job(
    name: str,
    queue: str,
    gpus: int = 1,
    *,
    pods: int = 1,
    t: float = 0.0,
    est: float | None = None,
    priority: int = 0,
    preemptible: bool = True,
    timeout: float | None = None,
) -> Job:
    """A job of `pods` pods of `gpus` whole GPUs each."""
    return Job(
        name=name,
        queue=queue,
        pods=tuple(Request(gpus=gpus) for _ in range(pods)),
        arrival=t,
        priority=priority,
        runtime_estimate=est,
        preemptible=preemptible,
        gang_timeout=timeout,
    )


def names(items: Any) -> list[str]:
    """The job names of admissions."""
    return [a.job.name for a in items]


def free_gpus(sched: Scheduler) -> float:
    """Free whole GPUs on the scheduler's cluster."""
    return sched.cap.free()["gpu"] / 1000
