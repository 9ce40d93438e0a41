"""Choosing the device backend: `--backend auto|nvml|sim`.

auto takes NVML when the library loads and reports at least one GPU; when it
does not, auto fails with a BackendUnavailable that says what was missing and
suggests `--backend sim`. It never falls back to a simulated node on its own:
an agent that silently simulated would advertise GPUs a node does not have.
This module only picks and builds a backend; it reads no configuration.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpunode.errors import BackendError, BackendUnavailable, ConfigError
from gpunode.node.devices.base import Backend
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.devices.simnode.backend import SimBackend

log = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "nvml", "sim")
DEFAULT_SIM_PROFILE = "dgx-h100"

_AUTO_HINT = (
    "install the NVIDIA driver (libnvidia-ml.so.1) and check `nvidia-smi`, "
    "or pass --backend sim (with --sim-profile NAME|PATH) to run on a simulated node"
)


def detect_backend(
    kind: str = "auto",
    sim_profile: str | Path | None = None,
    *,
    nvml: Any | None = None,
    probe_timeout_s: float = 5.0,
) -> Backend:
    """Build the backend `kind` names; `nvml` replaces the pynvml module (tests)."""
    if kind == "sim":
        return SimBackend.from_profile(sim_profile or DEFAULT_SIM_PROFILE, probe_timeout_s=probe_timeout_s)
    if sim_profile is not None:
        log.warning("--sim-profile %s is ignored: it only applies with --backend sim", sim_profile)
    if kind == "nvml":
        return NvmlBackend(nvml=nvml, probe_timeout_s=probe_timeout_s)
    if kind != "auto":
        raise ConfigError(f"--backend: expected one of {', '.join(BACKEND_KINDS)}, got {kind!r}")
    try:
        backend = NvmlBackend(nvml=nvml, probe_timeout_s=probe_timeout_s)
    except BackendUnavailable as e:
        raise BackendUnavailable(f"--backend auto found no GPU backend: {e}", hint=_AUTO_HINT) from None
    try:
        count = len(backend.gpus())
    except BackendError as e:
        backend.close()
        raise BackendUnavailable(
            f"--backend auto: NVML loaded but could not list the GPUs: {e}", hint=_AUTO_HINT
        ) from None
    if count == 0:
        driver = backend.driver_version()
        backend.close()
        raise BackendUnavailable(
            f"--backend auto: NVML loaded (driver {driver or 'unknown'}) but reports no GPU on this node",
            hint=_AUTO_HINT,
        )
    log.info("backend: NVML, driver %s, %d GPU(s)", backend.driver_version(), count)
    return backend
