"""The one exception tree of gpunode.

Every error that can stop the agent or a command derives from GpunodeError and
carries a hint: one sentence telling the operator what to do about it. Errors
from third-party libraries (NVML, gRPC, HTTP, YAML) are translated into this
tree at the edge where they occur; nothing else in the package should let a
foreign exception escape to the user.
"""

from __future__ import annotations


class GpunodeError(Exception):
    """Base class. str() gives the message followed by a HINT line."""

    default_hint = "see `gpunode doctor` for a diagnosis of this node"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint

    def __str__(self) -> str:
        return f"{self.message}\nHINT: {self.hint}"


class ConfigError(GpunodeError):
    """Invalid configuration: a file, an environment variable or a flag."""

    default_hint = (
        "fix the named key; `gpunode devices --config FILE` validates a file without starting anything"
    )


class ProfileError(ConfigError):
    """A simulated-node profile that cannot be loaded."""

    default_hint = "check the profile against the bundled ones (gpunode/node/devices/simnode/profiles/*.yaml)"


class BackendError(GpunodeError):
    """The device backend could not be initialised or queried."""

    default_hint = "run `gpunode doctor` to check the NVIDIA driver and NVML"


class BackendUnavailable(BackendError):
    """No usable backend: NVML missing, or no GPU present."""

    default_hint = (
        "install the NVIDIA driver (libnvidia-ml.so.1) on a GPU node, "
        "or pass --backend sim to run on a simulated node"
    )


class GpuLostError(BackendError):
    """A GPU fell off the bus or stopped answering (NVML_ERROR_GPU_IS_LOST and kin)."""

    default_hint = (
        "the GPU needs a reset or a reboot; its devices are marked unhealthy until it answers again"
    )

    def __init__(self, uuid: str, message: str | None = None) -> None:
        super().__init__(message or f"GPU {uuid} is lost")
        self.uuid = uuid


class DeviceNotFound(GpunodeError):
    """A device ID, GPU UUID or index that does not exist on this node."""

    default_hint = "list the node's devices with `gpunode devices`"


class AllocationError(GpunodeError):
    """A request the device plugin must refuse (unknown/unhealthy device, too many devices, ...)."""

    default_hint = "check the pod's resource request against `gpunode devices`"


class MemcapError(GpunodeError):
    """The memory-cap region or the native library is unusable."""

    default_hint = "reinstall gpunode so that the native library and the CFFI module are rebuilt"


class KubeError(GpunodeError):
    """A Kubernetes API or kubelet API call failed."""

    default_hint = "check the agent's service account RBAC and that the API server is reachable"
