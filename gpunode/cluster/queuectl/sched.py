"""Building the controller's Scheduler from what the API server holds.

A new leader, a changed configuration or a changed cluster starts a fresh
Scheduler: jobs already admitted are put back among its running jobs with the
plans written on their pods (and a preemption notice they carry, with the room
nominated to their preemptor: Scheduler.adopt), then the waiting jobs are submitted.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpunode.cluster.queuectl.jobs import JobPods, NoticeMark
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


def follow_idle(sched: Scheduler, jobs: Mapping[str, JobPods]) -> None:
    """Tell the Scheduler which running jobs are idle (every pod flagged by its node agent) and since when.

    The flag is a pod annotation, which the pod's owner may also write: a tenant that marks
    its own job idle only makes it the first victim under preemption.idleFirst, and a time
    that cannot be read is ignored (the job counts as busy).
    """
    for name in sched.running:
        j = jobs.get(name)
        sched.mark_idle(name, j.idle_since if j is not None else None)


def settle_heap() -> None:
    """After a rebuild: collect the old Scheduler, then freeze what is left out of the collector's reach.

    The rebuilt state (every pending and running job, the capacity index) is long-lived; left
    to the cyclic collector, each full collection walks all of it again: over 10,000 pending
    jobs that took p99 of an admission cycle from 68 ms to 205 ms (bench/admission.py,
    --no-freeze). Unfreezing first lets the previous Scheduler, frozen at the last rebuild and
    holding reference cycles, be collected instead of kept forever.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
