"""The one NVML query helper: every NVML call of gpunode goes through NvmlQuery.call.

It translates NVML's return codes into gpunode's error tree:

    NOT_SUPPORTED, NOT_FOUND, NO_PERMISSION,
    FUNCTION_NOT_FOUND, NO_DATA                  -> None (the value is absent)
    GPU_IS_LOST, GPU_NOT_FOUND, RESET_REQUIRED   -> GpuLostError
    UNKNOWN from a device that no longer answers
    to its UUID                                  -> GpuLostError
    LIBRARY_NOT_FOUND, DRIVER_NOT_LOADED,
    LIB_RM_VERSION_MISMATCH                      -> BackendUnavailable (with a hint)
    anything else                                -> BackendError naming the call

A call whose function the installed nvidia-ml-py does not have answers None,
as FUNCTION_NOT_FOUND would, and so does an unversioned call that nvidia-ml-py
refuses because the driver lacks its newest version (NVMLLibraryMismatchError).
A ctypes or OS error inside the bindings becomes a BackendError. The helper holds the NVML module it is given
(pynvml, or a fake in tests); it never imports pynvml itself (nvml.py does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from ctypes import ArgumentError
from typing import Any

from gpunode.errors import BackendError, BackendUnavailable, GpuLostError

# NVML return codes and constants: part of NVML's stable ABI.
SUCCESS = 0
ERR_UNINITIALIZED = 1
ERR_INVALID_ARGUMENT = 2
ERR_NOT_SUPPORTED = 3
ERR_NO_PERMISSION = 4
ERR_NOT_FOUND = 6
ERR_DRIVER_NOT_LOADED = 9
ERR_TIMEOUT = 10
ERR_LIBRARY_NOT_FOUND = 12
ERR_FUNCTION_NOT_FOUND = 13
ERR_GPU_IS_LOST = 15
ERR_RESET_REQUIRED = 16
ERR_LIB_RM_VERSION_MISMATCH = 18
ERR_NO_DATA = 21
ERR_GPU_NOT_FOUND = 28
ERR_UNKNOWN = 999

ABSENT = frozenset({ERR_NOT_SUPPORTED, ERR_NOT_FOUND, ERR_NO_PERMISSION, ERR_FUNCTION_NOT_FOUND, ERR_NO_DATA})
LOST = frozenset({ERR_GPU_IS_LOST, ERR_GPU_NOT_FOUND, ERR_RESET_REQUIRED})
UNAVAILABLE = {
    ERR_LIBRARY_NOT_FOUND: (
        "the NVML library (libnvidia-ml.so.1) could not be loaded: no NVIDIA driver is installed here, "
        "or this container was started without the NVIDIA runtime",
        None,
    ),
    ERR_DRIVER_NOT_LOADED: ("NVML is installed but the NVIDIA kernel driver is not loaded", None),
    ERR_LIB_RM_VERSION_MISMATCH: (
        "the NVML library and the loaded NVIDIA kernel driver are different versions",
        "reboot (or reload the nvidia kernel modules) after a driver upgrade",
    ),
}


class NvmlQuery:
    """The one choke point for NVML calls: call() runs one NVML function and translates its errors."""

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml

    def const(self, name: str, default: Any) -> Any:
        """The NVML module's constant `name`, or `default` where the installed nvidia-ml-py lacks it."""
        return getattr(self.nv, name, default)

    def call(
        self, fn: str, *args: Any, uuid: str | None = None, absent: Iterable[int] = (), **kw: Any
    ) -> Any:
        """nvml.<fn>(*args, **kw), or None when NVML says the value is absent (see the module docstring).

        `uuid` names the GPU the call is about, so a lost GPU raises GpuLostError(uuid);
        `absent` adds return codes that mean "no value" for this one call.
        """
        func = getattr(self.nv, fn, None)
        if func is None:
            return None  # the installed nvidia-ml-py predates this call: same as FUNCTION_NOT_FOUND
        mismatch = getattr(self.nv, "NVMLLibraryMismatchError", None) or ()
        try:
            return func(*args, **kw)
        except self.nv.NVMLError as e:
            code = getattr(e, "value", ERR_UNKNOWN)
            if code in ABSENT or code in absent:
                return None
            raise self.translate(fn, code, str(e), uuid) from None
        except mismatch:
            return None  # an unversioned call the driver lacks: the caller tries an older version
        except (ArgumentError, TypeError, ValueError, OSError) as e:
            where = f" for GPU {uuid}" if uuid else ""
            raise BackendError(f"NVML call {fn} failed{where}: {type(e).__name__}: {e}") from None

    def init(self) -> None:
        """nvmlInit, where every failure means the backend cannot be used at all."""
        try:
            self.nv.nvmlInit()
        except self.nv.NVMLError as e:
            code = getattr(e, "value", ERR_UNKNOWN)
            if code == ERR_NO_PERMISSION:
                raise BackendUnavailable(
                    f"no permission to open the NVIDIA devices (nvmlInit: {e})",
                    hint="run the agent as root or give it access to /dev/nvidiactl and /dev/nvidia*",
                ) from None
            raise self.translate("nvmlInit", code, str(e), None) from None

    def require(self, fn: str, *args: Any, uuid: str | None = None, **kw: Any) -> Any:
        """Like call(), for values gpunode cannot do without: an absent value is a BackendError."""
        value = self.call(fn, *args, uuid=uuid, **kw)
        if value is None:
            raise BackendError(f"NVML gave no answer to {fn} for {uuid or 'this node'}")
        return value

    def translate(self, fn: str, code: int, text: str, uuid: str | None) -> BackendError:
        """The gpunode error for NVML return code `code` from call `fn` (see the module docstring's table)."""
        if code in LOST and uuid is not None:
            return GpuLostError(uuid, f"GPU {uuid} is lost ({fn}: {text})")
        if code == ERR_UNKNOWN and uuid is not None and self.vanished(uuid):
            return GpuLostError(uuid, f"GPU {uuid} no longer answers ({fn}: {text})")
        if code in UNAVAILABLE:
            message, hint = UNAVAILABLE[code]
            return BackendUnavailable(f"{message} ({fn}: {text})", hint=hint)
        if code == ERR_UNINITIALIZED:
            return BackendError(f"NVML is not initialised ({fn}); the backend was closed")
        where = f" for GPU {uuid}" if uuid else ""
        return BackendError(f"NVML call {fn} failed{where}: {text} (NVML error {code})")

    def vanished(self, uuid: str) -> bool:
        """Whether a GPU no longer answers to its UUID (after an UNKNOWN error on it)."""
        try:
            self.nv.nvmlDeviceGetHandleByUUID(uuid)
        except self.nv.NVMLError as e:
            return getattr(e, "value", None) in (ERR_NOT_FOUND, ERR_UNKNOWN, *LOST)
        return False

    def field_values(
        self, handle: Any, fields: Sequence[int | tuple[int, int]], *, uuid: str
    ) -> list[int | float | None]:
        """Several NVML field values at once; None for each field the GPU cannot give."""
        values = self.call("nvmlDeviceGetFieldValues", handle, list(fields), uuid=uuid)
        if values is None:
            return [None] * len(fields)
        out: list[int | float | None] = []
        for v in list(values)[: len(fields)]:
            if v.nvmlReturn != SUCCESS:
                if v.nvmlReturn in LOST:
                    raise GpuLostError(uuid, f"GPU {uuid} is lost (field {v.fieldId})")
                out.append(None)
                continue
            out.append(_field_value(v))
        return out


def _field_value(v: Any) -> int | float | None:
    kinds = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    attr = kinds.get(int(v.valueType))
    return None if attr is None else getattr(v.value, attr)
