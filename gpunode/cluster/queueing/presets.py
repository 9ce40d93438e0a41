"""The scheduling policies compared in the time simulator: one engine, switched by a Preset.

"gpunode" is this project's policy; the others model what clusters run today so
the simulator can compare like with like (docs/queueing.md, "Baselines", says
what each models and what it leaves out):

- "kube": kube-scheduler alone. One global order by priority then arrival; a
  pod that does not fit does not block the pods behind it; no quotas; pods of a
  multi-pod job are placed one by one, so a partial gang can hold GPUs; a pod
  may preempt pods of strictly lower priority, which get the default 30 s
  termination grace period.
- "kueue-strict" / "kueue-besteffort": Kueue ClusterQueues. Each leaf queue is
  a ClusterQueue whose nominal quota is its guarantee, all in one cohort:
  borrowing of unused quota up to the borrowing limit, reclaim of borrowed
  quota and lower-priority preemption inside a ClusterQueue, all-or-nothing
  admission, no backfill, no usage memory. StrictFIFO: a head that cannot be
  admitted blocks its ClusterQueue; BestEffortFIFO: it does not.
- "kai": KAI-Scheduler. Hierarchical queues, DRF, time-based fair share, gangs,
  reclaim (up to the guarantee and towards the fair share) and priority
  preemption without a notice period; no backfill.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from gpunode.errors import ConfigError

# The grace period a Kubernetes pod gets when it is deleted (terminationGracePeriodSeconds' default).
POD_GRACE_S = 30.0


@dataclass(frozen=True)
class Preset:
    """The switches that turn the one engine into a policy.

    quotas: "hierarchical" (guarantees and borrow limits at every level of the
    tree), "flat" (leaves only: Kueue ClusterQueues in one cohort) or "none".
    order: how the next job is chosen: "fairshare" (queues by fair share and DRF),
    "kueue" (queue heads: not borrowing first, then priority, then arrival) or
    "global" (all pending jobs by priority then arrival, queues ignored).
    usage_memory: past usage lowers a queue's fair share (k from the config; off: k = 0).
    gang: all-or-nothing admission; off: pods are placed one by one as they fit.
    head_blocks: StrictFIFO: a queue's head that cannot be admitted blocks its queue.
    backfill: EASY backfill around a reservation for the head of line.
    reclaim: preempt borrowed work for a queue below its guarantee.
    share_reclaim: reclaim towards the fair share, for a queue below its fair share from
    queues above theirs: "off", "always" (KAI's rule: any queue above its share, at once) or
    "configured" (preemption.shareReclaim of the queue configuration: queues above a multiple
    of their share, for a job that has waited; off when the configuration has none).
    priority_preemption: preempt strictly lower-priority jobs.
    within_queue_only: priority preemption only inside the preemptor's own queue.
    notice_s / min_runtime_s: overrides of the configured notice period and
    minimum runtime (None: as configured).
    energy: use the configured energy weight (off: weight 0).
    """

    name: str
    quotas: str
    order: str
    usage_memory: bool
    gang: bool
    head_blocks: bool
    backfill: bool
    reclaim: bool
    share_reclaim: Literal["off", "always", "configured"]
    priority_preemption: bool
    within_queue_only: bool = False
    notice_s: float | None = None
    min_runtime_s: float | None = None
    energy: bool = False
    size_order: bool = False  # a job's place in its queue moves back by its size (config.OrderSettings)
    description: str = ""


GPUNODE = Preset(
    name="gpunode",
    quotas="hierarchical",
    order="fairshare",
    usage_memory=True,
    gang=True,
    head_blocks=False,
    backfill=True,
    reclaim=True,
    share_reclaim="configured",
    priority_preemption=True,
    energy=True,
    size_order=True,
    description="hierarchical quotas with borrowing and reclaim, time-based fair share and DRF, gangs, "
    "priority preemption with a notice period, EASY backfill, energy-aware placement",
)
KUBE = Preset(
    name="kube",
    quotas="none",
    order="global",
    usage_memory=False,
    gang=False,
    head_blocks=False,
    backfill=False,
    reclaim=False,
    share_reclaim="off",
    priority_preemption=True,
    notice_s=POD_GRACE_S,
    min_runtime_s=0.0,
    description="kube-scheduler alone: priority then arrival, unschedulable pods skipped, no quotas, "
    "pods of a gang placed one by one",
)
KUEUE_STRICT = Preset(
    name="kueue-strict",
    quotas="flat",
    order="kueue",
    usage_memory=False,
    gang=True,
    head_blocks=True,
    backfill=False,
    reclaim=True,
    share_reclaim="off",
    priority_preemption=True,
    within_queue_only=True,
    notice_s=POD_GRACE_S,
    min_runtime_s=0.0,
    description="Kueue StrictFIFO: ClusterQueues with nominal quota and borrowing in one cohort, "
    "reclaim preemption, the head blocks its queue",
)
KUEUE_BESTEFFORT = replace(
    KUEUE_STRICT,
    name="kueue-besteffort",
    head_blocks=False,
    description="Kueue BestEffortFIFO: as StrictFIFO, but a head that cannot be admitted does not block",
)
KAI = Preset(
    name="kai",
    quotas="hierarchical",
    order="fairshare",
    usage_memory=True,
    gang=True,
    head_blocks=False,
    backfill=False,
    reclaim=True,
    share_reclaim="always",
    priority_preemption=True,
    notice_s=POD_GRACE_S,
    min_runtime_s=0.0,
    description="KAI-Scheduler: hierarchical queues, DRF, time-based fair share, gangs, reclaim and "
    "priority preemption, no backfill",
)

PRESETS: dict[str, Preset] = {p.name: p for p in (GPUNODE, KUBE, KUEUE_STRICT, KUEUE_BESTEFFORT, KAI)}


def preset(name: str) -> Preset:
    """The preset called `name`; ConfigError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown scheduling policy {name!r}",
            hint=f"choose one of: {', '.join(PRESETS)}",
        ) from None
