"""Memory-cap regions: the agent's side of the GPU memory interposer.

A region is one directory per container allocation, ``<root>/<key>/``, with two
files: ``limit`` (written once here, mounted read-only into the container: the
GPU UUID(s), the cap and the device's memory) and ``usage`` (shared read-write
with libgpunode-preload.so: per-device usage and a slot per process). This
module creates, lists, reads, reclaims and removes regions, and says what a
container needs in order to be capped (environment and mounts).

It is the only user of the CFFI module ``gpunode._memcap``, which is compiled
from the same ``native/src/region.c`` as the preload library, so both sides
share one implementation of the layout, its checks and the reclaim protocol.

Must not: read os.environ or configuration files (callers pass paths and
sizes), talk to the kubelet, or change a region's counters except through the
C functions, which keep the cap's invariants.

The code lives in these modules, all re-exported here (``from gpunode.node import
memcap`` is how callers reach it): ``region`` (create, replace and load regions),
``directory`` (list, secure, remove and garbage-collect them), ``usage`` (read
usage, reclaim what exited processes held), ``problems`` (regions found
unusable, logged once) and ``container`` (the environment and mounts of a
capped container). A container may rewrite or truncate its usage file at any
moment: every read goes through SIGBUS-proof C wrappers (native/src/guard.c).
"""

from gpunode.node.memcap.container import (
    CONTAINER_DIR,
    ENV_LIMIT_INFO,
    ENV_LOG_LEVEL,
    ENV_REGION,
    LD_SO_PRELOAD_FILE,
    LIBRARY_NAME,
    ContainerSpec,
    MountSpec,
    container_spec,
    default_region_dir,
    preload_library_path,
)
from gpunode.node.memcap.directory import (
    gc_regions,
    list_regions,
    remove_region,
    remove_staging,
    scan_regions,
    secure_root,
)
from gpunode.node.memcap.problems import RegionProblem, region_problems
from gpunode.node.memcap.region import (
    LIMIT_FILE,
    LIMIT_FILE_MODE,
    REGION_DIR_MODE,
    REGIONS_ROOT_MODE,
    STALE_TEMP_AGE_S,
    USAGE_FILE,
    USAGE_FILE_MODE,
    DeviceCap,
    Region,
    create_multi_gpu_region,
    create_region,
    load_region,
    replace_region,
)
from gpunode.node.memcap.usage import DeviceUsage, ProcessUsage, RegionUsage, read_usage, reclaim_dead

__all__ = [
    "CONTAINER_DIR",
    "ENV_LIMIT_INFO",
    "ENV_LOG_LEVEL",
    "ENV_REGION",
    "LD_SO_PRELOAD_FILE",
    "LIBRARY_NAME",
    "LIMIT_FILE",
    "LIMIT_FILE_MODE",
    "REGIONS_ROOT_MODE",
    "REGION_DIR_MODE",
    "STALE_TEMP_AGE_S",
    "USAGE_FILE",
    "USAGE_FILE_MODE",
    "ContainerSpec",
    "DeviceCap",
    "DeviceUsage",
    "MountSpec",
    "ProcessUsage",
    "Region",
    "RegionProblem",
    "RegionUsage",
    "container_spec",
    "create_multi_gpu_region",
    "create_region",
    "default_region_dir",
    "gc_regions",
    "list_regions",
    "load_region",
    "preload_library_path",
    "read_usage",
    "reclaim_dead",
    "region_problems",
    "remove_region",
    "remove_staging",
    "replace_region",
    "scan_regions",
    "secure_root",
]
