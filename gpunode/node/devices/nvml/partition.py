"""Creating and destroying MIG instances through NVML (NvmlBackend.create_mig / destroy_mig).

A MIG device is a GPU instance with a compute instance in it. Creating one: the GPU instance
profile is found among NVML's (nvmlDeviceGetGpuInstanceProfileInfo for each profile constant,
matched to gpunode's profile table by compute slices and memory), created at the placement
(nvmlDeviceCreateGpuInstanceWithPlacement), then one compute instance over all its slices
(nvmlGpuInstanceGetComputeInstanceProfileInfo, nvmlGpuInstanceCreateComputeInstance); if the
compute instance cannot be made the GPU instance is destroyed again. Destroying one: the compute
instance, then the GPU instance (nvmlComputeInstanceDestroy, nvmlGpuInstanceDestroy), found from the
MIG device's handle. NVML refuses both while a process uses the instance (NVML_ERROR_IN_USE).
"""

from __future__ import annotations

from typing import Any

from gpunode.contract.names import MIB
from gpunode.errors import BackendError, DeviceNotFound, GpunodeError
from gpunode.node.devices.nvml.query import ERR_INVALID_ARGUMENT, NvmlQuery
from gpunode.node.devices.simnode.mig import MIG_TABLES

# NVML's GPU instance profile constants, without the media-extension (+me) variants (REV1).
GI_PROFILES = (
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2",
    "NVML_GPU_INSTANCE_PROFILE_2_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_3_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_4_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_6_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_7_SLICE",
    "NVML_GPU_INSTANCE_PROFILE_8_SLICE",
)
CI_PROFILE = "NVML_COMPUTE_INSTANCE_PROFILE_{}_SLICE"
CI_ENGINE_SHARED = 0  # NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED


def _act(q: NvmlQuery, fn: str, *args: Any, what: str) -> Any:
    """Run one NVML call that changes the GPU: every error is a BackendError (none means "absent")."""
    func = getattr(q.nv, fn, None)
    if func is None:
        raise BackendError(
            f"{what}: the installed nvidia-ml-py has no {fn}", hint="install nvidia-ml-py 12 or newer"
        )
    try:
        return func(*args)
    except q.nv.NVMLError as e:
        raise BackendError(f"{what}: {fn} failed: {e} (NVML error {getattr(e, 'value', '?')})") from None


def gi_profile(q: NvmlQuery, handle: Any, gpu_uuid: str, table: str, profile: str) -> Any:
    """NVML's GPU instance profile info for gpunode's profile name on this GPU (same compute slices,
    the closest memory size); BackendError naming the profiles NVML offers when none matches."""
    spec = MIG_TABLES[table].get(profile)
    if spec is None:
        raise BackendError(
            f"GPU {gpu_uuid}: {profile!r} is not a MIG profile of this GPU (profiles: {', '.join(MIG_TABLES[table])})"
        )
    best, offered = None, []
    for name in GI_PROFILES:
        const = q.const(name, None)
        if const is None:
            continue
        info = q.call(
            "nvmlDeviceGetGpuInstanceProfileInfo",
            handle,
            const,
            uuid=gpu_uuid,
            absent=(ERR_INVALID_ARGUMENT,),
        )
        if info is None:
            continue
        offered.append(f"{info.sliceCount}g/{info.memorySizeMB}MiB")
        if int(info.sliceCount) != spec.compute_slices:
            continue
        gap = abs(int(info.memorySizeMB) * MIB - spec.memory_bytes)
        if best is None or gap < best[0]:
            best = (gap, info)
    if best is None or best[0] > spec.memory_bytes // 4:
        raise BackendError(
            f"GPU {gpu_uuid}: NVML offers no GPU instance profile like {profile} "
            f"(it offers {', '.join(offered) or 'none'})"
        )
    return best[1]


def create(q: NvmlQuery, handle: Any, gpu_uuid: str, table: str, profile: str, start: int) -> tuple[int, int]:
    """Create the GPU instance and its compute instance; their IDs (gi, ci)."""
    info = gi_profile(q, handle, gpu_uuid, table, profile)
    placement = q.nv.c_nvmlGpuInstancePlacement_t()
    placement.start = start
    placement.size = MIG_TABLES[table][profile].memory_slices
    what = f"GPU {gpu_uuid}: creating MIG instance {profile} at memory slice {start}"
    gi = _act(q, "nvmlDeviceCreateGpuInstanceWithPlacement", handle, info.id, placement, what=what)
    try:
        gi_id = int(q.require("nvmlGpuInstanceGetInfo", gi, uuid=gpu_uuid).id)
        ci_const = q.const(CI_PROFILE.format(int(info.sliceCount)), None)
        if ci_const is None:
            raise BackendError(
                f"GPU {gpu_uuid}: this nvidia-ml-py has no compute instance profile of {info.sliceCount} slices"
            )
        ci_info = q.require(
            "nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, ci_const, CI_ENGINE_SHARED, uuid=gpu_uuid
        )
        ci = _act(q, "nvmlGpuInstanceCreateComputeInstance", gi, ci_info.id, what=what)
        ci_id = int(q.require("nvmlComputeInstanceGetInfo", ci, uuid=gpu_uuid).id)
    except GpunodeError:
        try:
            _act(q, "nvmlGpuInstanceDestroy", gi, what=what)
        except GpunodeError as cleanup:
            raise BackendError(
                f"GPU {gpu_uuid}: the compute instance of {profile} at memory slice {start} could not be made, "
                f"nor its GPU instance destroyed again ({cleanup})"
            ) from None
        raise
    return gi_id, ci_id


def destroy(q: NvmlQuery, mig_uuid: str) -> None:
    """Destroy the MIG device's compute instance and GPU instance."""
    mh = q.call("nvmlDeviceGetHandleByUUID", mig_uuid, uuid=mig_uuid, absent=(ERR_INVALID_ARGUMENT,))
    if mh is None:
        raise DeviceNotFound(f"NVML knows no MIG device {mig_uuid}")
    parent = q.require("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mh, uuid=mig_uuid)
    gi_id = int(q.require("nvmlDeviceGetGpuInstanceId", mh, uuid=mig_uuid))
    ci_id = int(q.require("nvmlDeviceGetComputeInstanceId", mh, uuid=mig_uuid))
    gi = q.require("nvmlDeviceGetGpuInstanceById", parent, gi_id, uuid=mig_uuid)
    ci = q.call(
        "nvmlGpuInstanceGetComputeInstanceById", gi, ci_id, uuid=mig_uuid, absent=(ERR_INVALID_ARGUMENT,)
    )
    what = f"destroying MIG device {mig_uuid}"
    if ci is not None:
        _act(q, "nvmlComputeInstanceDestroy", ci, what=what)
    _act(q, "nvmlGpuInstanceDestroy", gi, what=what)
