"""The `gpunode.dra` configuration section: gpunode as a Dynamic Resource Allocation (DRA) driver.

    gpunode:
      dra:
        enabled: true              # serve the kubelet's DRA plugin API (default false)
        driverName: gpu.gpunode.io # the driver name claims, DeviceClasses and ResourceSlices use
        devices: all               # the GPUs DRA serves: `all` or a list of GPU indexes / GPU UUIDs
        cdiDir: /var/run/cdi       # where the CDI specs of prepared claims are written
        kubeletRoot: /var/lib/kubelet  # plugins_registry/ and plugins/ are under it
        mig:
          partitioning: dynamic    # GPUs in MIG mode: `dynamic` (default) or `static`

A GPU is served by exactly one of the two kubelet APIs: the GPUs `devices` selects are served by
DRA and never advertised by the device plugin (whole, fractional or time-sliced); the device
plugin's settings apply to the others. A device-plugin setting that names one of DRA's GPUs
explicitly (gpunode.fractional.devices, a time-slicing resource's devices list) is refused here,
since one of the two would silently lose, with one exception: a time-slicing resource for whole GPUs
(sharing.timeSlicing, nvidia.com/gpu, not sharing.mps) may list GPUs DRA serves. DRA then publishes
each of them time-sliced, as the device plugin would advertise it: `replicas` claims share the GPU,
uncapped (time_sliced_replicas). DRA serves whole GPUs (shared by memory through claims' consumed
capacity, or time-sliced so) and GPUs in MIG mode, whose MIG placements it publishes; the list
names GPUs, never MIG devices.

`mig.partitioning` says which MIG placements of a GPU in MIG mode are published and how a claim for
one is prepared. `dynamic` (the default): every placement that overlaps no MIG instance gpunode did
not create, plus the placements of the instances the GPU has; a claim for a placement with no
instance gets one created when it is prepared, destroyed when it is unprepared, so the scheduler
packs profiles into what is left of the GPU. `static`: only the placements of the instances the GPU
has (the operator's layout, e.g. from nvidia-mig-parted); gpunode never creates or destroys one.
Either way instances gpunode did not create are never destroyed.

This module only parses; the kubelet plugin is gpunode.node.dra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpunode.config.sharing import (
    GPU_RESOURCE,
    DeviceSelector,
    SharedResource,
    TimeSlicing,
    parse_device_selector,
)
from gpunode.contract.reader import SectionReader, excerpt
from gpunode.errors import ConfigError

DEFAULT_DRIVER_NAME = "gpu.gpunode.io"
DEFAULT_CDI_DIR = Path("/var/run/cdi")
MIG_STATIC, MIG_DYNAMIC = "static", "dynamic"
MIG_PARTITIONING = (MIG_DYNAMIC, MIG_STATIC)
MAX_DRIVER_NAME_CHARS = 63  # the kubelet's limit: a driver name is a DNS subdomain of at most 63 characters
MAX_PATH_CHARS = 4096
# A DNS subdomain (RFC 1123): lower-case labels of letters, digits and '-', joined by dots. DRA driver
# names must also contain a dot (a domain the vendor owns), as the Kubernetes API validates them.
_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})+")


@dataclass(frozen=True)
class DraConfig:
    """Settings of the DRA kubelet plugin (gpunode.node.dra): off unless enabled."""

    enabled: bool = False
    driver_name: str = DEFAULT_DRIVER_NAME
    # The GPUs DRA serves when enabled (all unless listed); the device plugin serves the others.
    devices: DeviceSelector = field(default_factory=DeviceSelector)
    cdi_dir: Path = DEFAULT_CDI_DIR
    kubelet_root: Path | None = None  # None: the parent of gpunode.kubeletDir (/var/lib/kubelet)
    mig_partitioning: str = MIG_DYNAMIC  # MIG_DYNAMIC: create instances at prepare; MIG_STATIC: the GPU's own

    @property
    def mig_dynamic(self) -> bool:
        """Whether MIG instances are created at prepare and destroyed at unprepare."""
        return self.mig_partitioning == MIG_DYNAMIC

    def serves(self, index: int, uuid: str) -> bool:
        """Whether DRA serves this whole GPU (and the device plugin therefore does not)."""
        return self.enabled and self.devices.matches(index, uuid)

    def root(self, kubelet_dir: Path) -> Path:
        """The kubelet's root directory: kubeletRoot, else the parent of the device-plugin directory."""
        return self.kubelet_root if self.kubelet_root is not None else kubelet_dir.parent

    def registration_socket(self, kubelet_dir: Path) -> Path:
        """Where the kubelet's plugin watcher finds the driver: <root>/plugins_registry/<driver>-reg.sock."""
        return self.root(kubelet_dir) / "plugins_registry" / f"{self.driver_name}-reg.sock"

    def plugin_dir(self, kubelet_dir: Path) -> Path:
        """The driver's own directory under the kubelet's: <root>/plugins/<driver>/."""
        return self.root(kubelet_dir) / "plugins" / self.driver_name

    def service_socket(self, kubelet_dir: Path) -> Path:
        """The DRA service socket the kubelet dials: <root>/plugins/<driver>/dra.sock."""
        return self.plugin_dir(kubelet_dir) / "dra.sock"


def check_driver_name(value: str, where: str) -> str:
    """A DRA driver name: a DNS subdomain with at least one dot, at most 63 characters, starting with a
    letter (it is also the vendor of the claims' CDI devices, and CDI vendor names start with one)."""
    if len(value) > MAX_DRIVER_NAME_CHARS or not _DNS_SUBDOMAIN.fullmatch(value) or not value[0].isalpha():
        raise ConfigError(
            f"{where}: {excerpt(value)} is not a DRA driver name (a lower-case DNS subdomain with a dot, "
            f"starting with a letter, at most {MAX_DRIVER_NAME_CHARS} characters)",
            hint=f"use a domain of your own such as {DEFAULT_DRIVER_NAME}",
        )
    return value


def parse_dra_config(data: object, where: str) -> DraConfig:
    """Validate the `gpunode.dra` section (a mapping; missing or null means DRA off)."""
    r = SectionReader(data, where)
    if r.has("devices") and r.raw("devices", None) is None:  # `devices:` left empty, e.g. by a template
        raise r.fail(
            "devices",
            "the key is present but empty; it would otherwise give every GPU to DRA",
            hint="write `devices: all`, list GPU indexes or UUIDs, or remove the key",
        )
    devices = r.parse("devices", parse_device_selector, DeviceSelector())
    if devices.mig_indexes or any(u.startswith("MIG-") for u in devices.uuids):
        raise r.fail(
            "devices",
            "DRA serves whole GPUs, not MIG devices",
            hint="list GPU indexes or GPU UUIDs (GPU-...), or `all`",
        )
    cfg = DraConfig(
        enabled=r.flag("enabled", False),
        driver_name=check_driver_name(
            r.get("driverName", str, DEFAULT_DRIVER_NAME), r.key_path("driverName")
        ),
        devices=devices,
        cdi_dir=_path(r, "cdiDir", str(DEFAULT_CDI_DIR)),
        kubelet_root=_path(r, "kubeletRoot", None),
        mig_partitioning=_mig_partitioning(r),
    )
    r.finish()
    return cfg


def _mig_partitioning(r: SectionReader) -> str:
    """`mig.partitioning`: dynamic (the default) or static."""
    if r.has("mig") and r.raw("mig", None) is None:
        raise r.fail(
            "mig", "the key is present but empty", hint="write `mig: {partitioning: dynamic}` or remove it"
        )
    mig = r.section("mig")
    value = mig.choice("partitioning", MIG_PARTITIONING, MIG_DYNAMIC)
    mig.finish()
    return value


def _path(r: SectionReader, key: str, default: str | None) -> Any:
    """An absolute path setting (None when absent without a default)."""
    value = r.get(key, str, default)
    if value is None:
        return None
    if not value.startswith("/") or len(value) > MAX_PATH_CHARS or "\0" in value:
        raise r.fail(
            key,
            f"expected an absolute path of at most {MAX_PATH_CHARS} characters, got {excerpt(value)}",
            hint="give the directory as an absolute path",
        )
    return Path(value)


def check_exclusive(dra: DraConfig, fractional: DeviceSelector | None, sliced: list[DeviceSelector]) -> None:
    """Refuse a device-plugin selection that explicitly names a GPU DRA serves: a GPU is served by one
    of the two kubelet APIs, never both. `all` in a device-plugin setting means all of the device
    plugin's GPUs (those DRA does not serve), so it never clashes, except fractional sharing asked for
    while DRA serves every GPU (it would share nothing). A UUID against an index is checked by the
    inventory, which knows both."""
    if not dra.enabled:
        return
    for selector in ([fractional] if fractional is not None else []) + sliced:
        if selector.all:
            if selector is not fractional or not dra.devices.all:
                continue
            clash = "all GPUs"
        else:
            named = [f"index {i}" for i in selector.indexes if dra.devices.all or i in dra.devices.indexes]
            named += [u for u in selector.uuids if dra.devices.all or u in dra.devices.uuids]
            if not named:
                continue
            clash = ", ".join(named)
        raise ConfigError(
            f"{selector.where}: {clash} would be served by the device plugin, but gpunode.dra.devices "
            f"({dra.devices.describe()}) gives them to DRA; a GPU is served by one of the two",
            hint="list the GPUs DRA serves in gpunode.dra.devices and the others in the device-plugin setting",
        )


def dra_time_slicing(time_slicing: TimeSlicing) -> tuple[SharedResource, ...]:
    """The time-slicing resources that may list GPUs DRA serves: nvidia.com/gpu, by an explicit list, not MPS
    (an MPS replica is a memory cap and a hard compute share, which DRA's shared device already is)."""
    if time_slicing.mps:
        return ()
    return tuple(r for r in time_slicing.resources if r.name == GPU_RESOURCE and not r.devices.all)


def time_sliced_replicas(dra: DraConfig, time_slicing: TimeSlicing, index: int, uuid: str) -> int | None:
    """The replicas a GPU DRA serves is time-sliced into (its time-slicing resource's), or None."""
    if not dra.serves(index, uuid):
        return None
    for r in dra_time_slicing(time_slicing):
        if index in r.devices.indexes or uuid in r.devices.uuids:
            return r.replicas
    return None
