"""What a container needs in order to be capped: the interposer's environment and mounts."""

from __future__ import annotations

import contextlib
import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from gpunode.errors import MemcapError
from gpunode.node.files import write_atomically
from gpunode.node.memcap.region import LIMIT_FILE, LIMIT_FILE_MODE, USAGE_FILE, Region, _io_error, _native

ENV_REGION = "GPUNODE_MEMCAP_REGION"  # honoured by the library only when nothing is at the fixed path
ENV_LOG_LEVEL = "GPUNODE_MEMCAP_LOG_LEVEL"
ENV_LIMIT_INFO = "GPUNODE_MEMCAP_LIMIT_BYTES"
LD_SO_PRELOAD_FILE = "ld.so.preload"
LIBRARY_NAME = "libgpunode-preload.so"
# Fixed: the library finds its region at CONTAINER_DIR/memcap (GPUNODE_MEMCAP_DEFAULT_DIR in
# the C header) and trusts it only there, so it is not configurable.
CONTAINER_DIR = "/var/run/gpunode"


@dataclass(frozen=True)
class MountSpec:
    """One bind mount Allocate asks for: host_path appears at container_path, read-only or read-write."""

    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class ContainerSpec:
    """What Allocate hands the kubelet for a capped container."""

    envs: dict[str, str]
    mounts: tuple[MountSpec, ...]


def default_region_dir() -> str:
    """The fixed path where the interposer finds (and trusts) the region mounted into a container."""
    m = _native()
    return str(m.ffi.string(m.lib.gpunode_memcap_default_region_dir()).decode())


def preload_library_path() -> Path:
    """The installed libgpunode-preload.so (built into gpunode/lib/ by the package build)."""
    resource = importlib.resources.files("gpunode") / "lib" / LIBRARY_NAME
    if not isinstance(resource, Path) or not resource.is_file():
        raise MemcapError(
            f"the preload library {resource} is missing",
            hint="reinstall gpunode with `pip install .` on a machine with a C compiler, so native/ is built",
        )
    return resource


def _write_if_changed(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    write_atomically(path, text, mode=LIMIT_FILE_MODE)


def container_spec(
    region: Region,
    *,
    preload_lib: Path | None = None,
    visible_device: str,
    ld_so_preload: bool = False,
) -> ContainerSpec:
    """The environment and mounts that cap a container with region.

    The library and the limit file are mounted read-only, the usage file read-write, at the
    fixed container path CONTAINER_DIR: the library trusts a region only there, on a read-only
    mount, whatever the container's environment says. With ld_so_preload, an /etc/ld.so.preload
    naming the library is mounted too (written into the region directory), so a process that
    clears its environment is still capped.
    """
    if not visible_device:
        raise MemcapError(
            "visible_device is empty", hint="pass the GPU UUID (or index) the container may see"
        )
    library = Path(preload_lib) if preload_lib is not None else preload_library_path()
    library_in_container = f"{CONTAINER_DIR}/lib/{LIBRARY_NAME}"
    region_in_container = f"{CONTAINER_DIR}/memcap"
    envs = {
        "LD_PRELOAD": library_in_container,
        ENV_REGION: region_in_container,  # the fixed path itself: informational, never a redirect
        "NVIDIA_VISIBLE_DEVICES": visible_device,
        ENV_LIMIT_INFO: ",".join(str(d.limit_bytes) for d in region.devices),
    }
    mounts = [
        MountSpec(library_in_container, str(library), True),
        MountSpec(f"{region_in_container}/{LIMIT_FILE}", str(region.limit_path), True),
        MountSpec(f"{region_in_container}/{USAGE_FILE}", str(region.usage_path), False),
    ]
    if ld_so_preload:
        preload_file = region.path / LD_SO_PRELOAD_FILE
        try:
            _write_if_changed(preload_file, library_in_container + "\n")
        except OSError as exc:
            raise _io_error(f"cannot write {preload_file}", exc, region.path) from exc
        mounts.append(MountSpec("/etc/ld.so.preload", str(preload_file), True))
    return ContainerSpec(envs=envs, mounts=tuple(mounts))
