"""Building the controller's Scheduler from what the API server holds.

A new leader, a changed configuration or a changed cluster starts a fresh
Scheduler: jobs already admitted are put back among its running jobs with the
plans written on their pods (and a preemption notice they carry, with the room
nominated to their preemptor: Scheduler.adopt), then the waiting jobs are submitted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gpunode.cluster.queuectl.jobs import NoticeMark
from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import Job, Plan
from gpunode.cluster.queueing.presets import preset
from gpunode.errors import GpunodeError
from gpunode.placement.frag import TargetPod, TargetWorkload
from gpunode.placement.model import MILLI_PER_GPU, NodeState

log = logging.getLogger(__name__)
PRESET = "gpunode"
# Scored against before any pod was seen: one whole GPU per pod
DEFAULT_WORKLOAD = TargetWorkload(
    (TargetPod(cpu_milli=0, gpu_milli=MILLI_PER_GPU, gpus=1, gpu_models=None, weight=1),)
)


@dataclass(frozen=True)
class Running:
    """An admitted job read back from its pods."""

    job: Job
    plan: Plan
    start: float
    notice: NoticeMark | None


def adopt(sched: Scheduler, r: Running, now: float) -> bool:
    """Put an admitted job among the running ones on its own plan; False (logged) when the plan does not fit."""
    notice = r.notice
    try:
        sched.adopt(
            r.job,
            r.plan,
            r.start,
            now,
            notice_deadline=notice.deadline if notice is not None else None,
            preemptor=notice.preemptor if notice is not None else None,
        )
    except (GpunodeError, ValueError) as exc:
        log.warning("admitted job %s no longer fits the cluster as published: %s", r.job.name, exc)
        return False
    return True


def build(
    config: QueueConfig,
    nodes: Sequence[NodeState],
    running: Sequence[Running],
    waiting: Sequence[Job],
    now: float,
    workload: TargetWorkload | None = None,
) -> tuple[Scheduler, list[str]]:
    """A Scheduler holding `running` and with `waiting` submitted; also the running jobs it could not place."""
    cap = ClusterCapacity(
        nodes,
        workload=workload or DEFAULT_WORKLOAD,
        policy=config.placement_policy,
        energy_weight=config.energy_weight,
    )
    sched = Scheduler(config, cap, preset(PRESET))
    lost = []
    for r in sorted(running, key=lambda r: (r.start, r.job.name)):
        if not adopt(sched, r, now):
            lost.append(r.job.name)
    for job in sorted(waiting, key=lambda j: (j.arrival, j.name)):
        sched.submit(job, now)
    return sched, lost
