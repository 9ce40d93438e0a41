"""The names the node and the cluster agree on: resources, annotations, units and sharing modes.

The agent advertises resources and publishes annotations under these names;
the extender and the simulator read them. Any name that crosses the node /
cluster boundary, or that the kubelet and pods see, is spelled here once.
Device-ID formats live beside this module, in gpunode.contract.deviceids.
"""

from __future__ import annotations

import enum

# -- units --------------------------------------------------------------------------------------

KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40
MILLI_PER_GPU = 1000  # compute share: 1000 milli-GPU is one whole GPU

# -- extended resources -------------------------------------------------------------------------

NVIDIA_DOMAIN = "nvidia.com"
GPU_RESOURCE = "nvidia.com/gpu"  # whole GPUs (and MIG devices under migStrategy single)
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # + profile, e.g. nvidia.com/mig-1g.10gb
SHARED_SUFFIX = ".shared"  # a time-sliced resource renamed by default: nvidia.com/gpu.shared
GPU_MEMORY_RESOURCE = "gpunode.io/gpu-memory"  # fractional GPUs, in units of memory

# -- annotations --------------------------------------------------------------------------------

NODE_STATE_ANNOTATION = "gpunode.io/gpu-state"  # Node: the agent's GPU state (gpunode.contract.nodestate)
UNHEALTHY_GPUS_ANNOTATION = "gpunode.io/unhealthy-gpus"  # Node: UUID -> reason, set by remediation
ASSIGNMENT_ANNOTATION = "gpunode.io/gpu-assigned"  # Pod: the GPUs the extender bound it to
ALLOCATED_ANNOTATION = "gpunode.io/gpu-allocated"  # Pod: the GPUs the node gave it (assignment carried out)
GPU_MILLI_ANNOTATION = "gpunode.io/gpu-milli"  # Pod: the compute share it asks for
GPU_MODEL_ANNOTATION = "gpunode.io/gpu-model"  # Pod: the GPU models it accepts, `|`-separated
GPU_IDLE_ANNOTATION = "gpunode.io/gpu-idle-since"  # Pod: RFC 3339 time its GPUs went idle (node.idle)
# The queue controller (gpunode.cluster.queuectl): which queue and gang a pod belongs to, and what it decided
QUEUE_LABEL = "gpunode.io/queue"  # Pod: the leaf queue it waits in
GANG_LABEL = "gpunode.io/gang"  # Pod: the gang (admitted all at once) it is a member of, within its namespace
GANG_SIZE_LABEL = "gpunode.io/gang-size"  # Pod: how many members its gang has
RUNTIME_ANNOTATION = "gpunode.io/runtime-estimate"  # Pod: expected runtime (30m, 2h) for backfill
QUEUE_ADMITTED_ANNOTATION = "gpunode.io/queue-admitted"  # Pod: the admission (JSON: job, node, GPUs)
PREEMPTION_NOTICE_ANNOTATION = "gpunode.io/preemption-notice"  # Pod: JSON: deadline, preemptor, reason
QUEUE_REASON_ANNOTATION = "gpunode.io/queue-reason"  # Pod: why it waits (also an Event)
# Pod: the scheduling gate that keeps a governed pod away from kube-scheduler until the controller admits it
# (added at creation by the controller's mutating webhook, or by the user; docs/admission.md)
ADMISSION_GATE = "gpunode.io/admission"
# The webhook's path on `gpunode queue --webhook-listen` (the chart's MutatingWebhookConfiguration calls it)
ADMISSION_WEBHOOK_PATH = "/mutate-pods"
# Pod, Job, JobSet: Kueue's queue label, read as gpunode.io/queue when kueue.queueNameLabel is true
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# JobSet (sigs.k8s.io/jobset): the API the queue controller reads, and the label its controller puts on
# each Job it makes: the replicated job the Job is a replica of
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"

# -- labels -------------------------------------------------------------------------------------

# Pod: set to "leader" on the extender replica that holds the leader Lease (its Service selects it)
EXTENDER_ROLE_LABEL = "gpunode.io/extender-role"


# -- telemetry series the extender reads back from Prometheus ------------------------------------

# The agent exports these (dcgm-exporter's names); the extender's energy- and load-aware scores query them.
POWER_USAGE_SERIES = "DCGM_FI_DEV_POWER_USAGE"  # W, per GPU
GPU_UTIL_SERIES = "DCGM_FI_DEV_GPU_UTIL"  # %, per GPU (absent on a MIG-enabled GPU)
FB_USED_SERIES = "DCGM_FI_DEV_FB_USED"  # MiB, per GPU and per MIG instance
FB_FREE_SERIES = "DCGM_FI_DEV_FB_FREE"  # MiB, per GPU and per MIG instance
NODE_SERIES_LABEL = "Hostname"  # the node's name on every series ("hostname" with hostnameLabel)
MIG_INSTANCE_LABEL = "GPU_I_ID"  # set only on a MIG instance's series


def mig_resource_profile(profile: str) -> str:
    """A MIG profile as resource names spell it: NVML's `+` suffixes (1g.10gb+me, 1g.24gb+gfx) are not
    allowed in a resource name, so `+` becomes `.` as in NVIDIA's plugin (1g.10gb.me)."""
    return profile.replace("+", ".")


def mig_resource_name(profile: str) -> str:
    """The resource of one MIG profile: nvidia.com/mig-1g.10gb for 1g.10gb, nvidia.com/mig-1g.10gb.me for
    1g.10gb+me."""
    return f"{MIG_RESOURCE_PREFIX}{mig_resource_profile(profile)}"


def mig_profile_of(resource: str) -> str | None:
    """The MIG profile a resource names (1g.10gb for nvidia.com/mig-1g.10gb), or None for any other; a
    suffix comes back as resource names spell it (1g.10gb.me, see mig_resource_profile)."""
    if resource.startswith(MIG_RESOURCE_PREFIX) and len(resource) > len(MIG_RESOURCE_PREFIX):
        return resource[len(MIG_RESOURCE_PREFIX) :]
    return None


def shared_resource_default(resource: str) -> str:
    """The name a time-sliced resource gets when renamed by default: nvidia.com/gpu.shared."""
    return f"{resource}{SHARED_SUFFIX}"


# -- sharing modes ------------------------------------------------------------------------------


class Sharing(enum.StrEnum):
    """How one physical GPU is shared; the agent decides it per GPU and publishes it.

    Members are strings, so a mode compares equal to its published name ("time-sliced").
    """

    WHOLE = "whole"  # handed out whole, one container at a time
    FRACTIONAL = "fractional"  # memory units with a cap enforced by the interposer
    TIME_SLICED = "time-sliced"  # replicas that share the GPU without isolation
    MIG = "mig"  # split into MIG instances
    DRA = "dra"  # served through the DRA kubelet plugin (gpunode.dra), not the device plugin


SHARING_MODES: tuple[str, ...] = tuple(m.value for m in Sharing)
