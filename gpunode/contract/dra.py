"""The names gpunode uses as a DRA driver: device attributes, capacities, DeviceClasses and device taints.

The agent publishes its GPUs in ResourceSlices under these names (gpunode.node.dra.slices); the
chart's DeviceClasses select on them in CEL, users' claims select and tolerate them. The driver
name itself is configurable (gpunode.dra.driverName, default DEFAULT_DRIVER); attribute and
capacity names without a domain are qualified by the driver's name, as the API defines it, so a
claim writes `device.attributes["gpu.gpunode.io"].productName`.
"""

from __future__ import annotations

import re

DEFAULT_DRIVER = "gpu.gpunode.io"

# -- device attributes (qualified by the driver name) ---------------------------------------------

ATTR_TYPE = "type"  # "gpu" or "mig"
ATTR_SHARING = "sharing"  # SHARING_WHOLE, SHARING_SHARED or SHARING_MIG: which DeviceClass takes it
ATTR_UUID = "uuid"  # GPU-... (for a MIG placement: its GPU's)
ATTR_PRODUCT = "productName"  # NVML's name, "NVIDIA H100 80GB HBM3"
ATTR_ARCHITECTURE = "architecture"  # "hopper", "ampere", "turing", ...
ATTR_COMPUTE_CAPABILITY = "cudaComputeCapability"  # version, "9.0.0"
ATTR_DRIVER_VERSION = "driverVersion"  # version, "550.90.7" (NVML's "550.90.07" as a semantic version)
ATTR_INDEX = "index"  # NVML index of the GPU
ATTR_PCI_BUS_ID = "pciBusID"  # "0000:18:00.0"
ATTR_NUMA_NODE = "numaNode"  # int, absent where the GPU has none
ATTR_NVLINK_DOMAIN = "nvlinkDomain"  # int: the lowest index of the GPUs joined by NVLink, absent without
ATTR_MIG_PROFILE = "profile"  # MIG placements: "1g.10gb"
ATTR_MIG_START = "memorySliceStart"  # MIG placements: the first of the GPU's 8 memory slices it takes

TYPE_GPU, TYPE_MIG = "gpu", "mig"
SHARING_WHOLE, SHARING_SHARED, SHARING_MIG = "whole", "shared", "mig"
SHARING_TIME_SLICED = "timesliced"  # a GPU sharing.timeSlicing names: claims share it, uncapped

# -- capacities ------------------------------------------------------------------------------------

CAPACITY_MEMORY = "memory"  # bytes: a GPU's framebuffer, or a MIG profile's
CAPACITY_COMPUTE = "compute"  # milli-GPU (1000 is the whole GPU): a shared device's compute shares
CAPACITY_REPLICAS = "replicas"  # a time-sliced device: its replicas, one per claim

# -- shared counters of one GPU (partitionable devices) --------------------------------------------

COUNTER_MEMORY = "memory"  # bytes: taken whole by the whole-GPU device and by the shared one
COUNTER_COMPUTE_SLICES = "compute-slices"  # MIG: 7 compute slices
MIG_MEMORY_SLICE_COUNTER = "memory-slice-{}"  # MIG: one counter per memory slice, 0..7

# -- DeviceClasses the chart ships (helm/gpunode/templates/dra-deviceclasses.yaml) -----------------

CLASS_WHOLE = "gpu.gpunode.io"  # one GPU to one claim; extendedResourceName: nvidia.com/gpu
CLASS_SHARED = "shared-gpu.gpunode.io"  # a share of a GPU's memory; several claims per GPU
CLASS_MIG = "mig.gpunode.io"  # one MIG placement
CLASS_TIME_SLICED = "timesliced-gpu.gpunode.io"  # one replica of a time-sliced GPU; several claims per GPU

# -- device taints (health) ---------------------------------------------------------------------------

TAINT_KEY = "gpunode.io/unhealthy"  # value: what is wrong ("xid-79", "gpu-lost"); NoExecute or NoSchedule
NO_EXECUTE, NO_SCHEDULE = "NoExecute", "NoSchedule"

# -- what a prepared claim is called on the node ------------------------------------------------------
#
# The kubelet plugin names each allocation result of a claim a CDI device `<driver>/claim=<uid>-<n>`
# and gives a capped claim the memory-cap region `claim-<uid>`; the kubelet's pod-resources API lists
# the CDI devices of every container's claims, which is how the metrics find a claim's region.

CDI_CLASS = "claim"
CLAIM_REGION_PREFIX = "claim-"
# A Kubernetes UID as the API server makes them (RFC 4122 text form).
CLAIM_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def claim_cdi_id(driver: str, uid: str, n: int) -> str:
    """The fully qualified CDI device ID of a claim's n-th allocation result: `<driver>/claim=<uid>-<n>`."""
    return f"{driver}/{CDI_CLASS}={uid}-{n}"


def claim_of_cdi_id(driver: str, cdi_id: str) -> tuple[str, int] | None:
    """(claim UID, n) from a CDI device ID of this driver's claims; None for any other ID."""
    prefix = f"{driver}/{CDI_CLASS}="
    if not cdi_id.startswith(prefix):
        return None
    uid, sep, n = cdi_id[len(prefix) :].rpartition("-")
    if not sep or not n.isascii() or not n.isdigit() or len(n) > 3 or not CLAIM_UID.fullmatch(uid):
        return None
    return uid, int(n)


def claim_region_key(uid: str) -> str:
    """The memory-cap region of a prepared claim."""
    return f"{CLAIM_REGION_PREFIX}{uid}"
