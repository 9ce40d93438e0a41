"""CDI specs of prepared claims: built from the claim's plan, written atomically, removed on unprepare.

One spec file per claim, `<cdiDir>/<driver>-<claim UID>.json`, mode 0644, kind
`<driver>/claim`, one CDI device per allocation result named `<claim UID>-<n>`. The container
runtime (containerd with CDI on) injects what the devices of the claim list:

- each device: its GPU's device node (/dev/nvidia<minor>) and, for a MIG device, its GPU and
  compute instances' capability nodes (/dev/nvidia-caps/nvidia-cap<minor>);
- the spec's own edits, applied once whichever of its devices a container gets: the control
  device nodes (nvidiactl, nvidia-uvm, nvidia-uvm-tools), NVIDIA_VISIBLE_DEVICES with the claim's
  GPU UUIDs (a MIG device's `MIG-<uuid>`) and, when a device is capped, the interposer: LD_PRELOAD and its library mount, and
  the region's files at the fixed container path (the limit file read-only, as the device plugin
  mounts them; gpunode.node.memcap.container_spec decides both).

The file's name comes from the claim UID alone (checked to be a UID first) and the driver name
(a DNS subdomain, checked by the configuration), never from a claim's name or namespace, so no
claim can name a file outside the CDI directory. The file is staged under a name CDI does not read
(`.<name>.<pid>.tmp`) and renamed into place, so the runtime never sees half a spec.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpunode.contract import dra as names
from gpunode.node.dra.claims import check_uid
from gpunode.node.files import write_atomically
from gpunode.node.memcap import ContainerSpec

CDI_VERSION = "0.6.0"  # deviceNodes, mounts and env in device and spec edits; containerd 2 reads it
CDI_CLASS = names.CDI_CLASS
SPEC_MODE = 0o644
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def spec_path(cdi_dir: Path, driver: str, uid: str) -> Path:
    """The claim's spec file: `<cdi_dir>/<driver>-<uid>.json` (the UID checked first)."""
    return cdi_dir / f"{driver}-{check_uid(uid)}.json"


def device_name(uid: str, n: int) -> str:
    """The CDI device name of the claim's n-th allocation result."""
    return f"{check_uid(uid)}-{n}"


def device_id(driver: str, uid: str, n: int) -> str:
    """The fully qualified CDI device ID the kubelet hands to the runtime: `<driver>/claim=<uid>-<n>`."""
    return names.claim_cdi_id(driver, check_uid(uid), n)


def _mount(container_path: str, host_path: str, read_only: bool) -> dict[str, Any]:
    return {
        "hostPath": host_path,
        "containerPath": container_path,
        "options": ["ro" if read_only else "rw", "nosuid", "nodev", "bind"],
    }


def build_spec(
    *,
    driver: str,
    uid: str,
    gpu_minors: Sequence[int],
    gpu_uuids: Sequence[str],
    device_root: str = "/",
    with_device_nodes: bool = True,
    cap: ContainerSpec | None = None,
    extra_nodes: Sequence[Sequence[str]] = (),
) -> dict[str, Any]:
    """The CDI spec of one claim: one device per allocation result (gpu_minors[n] is result n's GPU,
    gpu_uuids[n] what it is visible as: its GPU's UUID, or a MIG device's `MIG-...`; extra_nodes[n]
    further device nodes of result n, a MIG device's capability nodes)."""
    root = device_root.rstrip("/")

    def node(path: str) -> dict[str, str]:
        return {"path": path, "hostPath": f"{root}{path}"}

    # Every device carries NVIDIA_VISIBLE_DEVICES (the same value for each device of the claim, so a
    # container given several gets one value) and its GPU's device node; CDI refuses a device without
    # edits, which a simulated GPU, without a device node, would otherwise be.
    visible = f"NVIDIA_VISIBLE_DEVICES={','.join(dict.fromkeys(gpu_uuids))}"
    devices = []
    for n, minor in enumerate(gpu_minors):
        device_edits: dict[str, Any] = {"env": [visible]}
        if with_device_nodes:
            extra = extra_nodes[n] if n < len(extra_nodes) else ()
            device_edits["deviceNodes"] = [node(p) for p in (f"/dev/nvidia{minor}", *extra)]
        devices.append({"name": device_name(uid, n), "containerEdits": device_edits})
    edits: dict[str, Any] = {"env": [visible]}
    if cap is not None:
        env = dict(cap.envs)
        env.pop("NVIDIA_VISIBLE_DEVICES", None)
        edits["env"] = sorted([visible, *(f"{k}={v}" for k, v in env.items())])
        edits["mounts"] = [_mount(m.container_path, m.host_path, m.read_only) for m in cap.mounts]
    if with_device_nodes:
        edits["deviceNodes"] = [node(p) for p in CONTROL_NODES]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": f"{driver}/{CDI_CLASS}",
        "devices": devices,
        "containerEdits": edits,
    }


def write_spec(cdi_dir: Path, driver: str, uid: str, spec: dict[str, Any]) -> Path:
    """Write the claim's spec atomically (mode 0644); creates the CDI directory (0755) if missing."""
    path = spec_path(cdi_dir, driver, uid)
    cdi_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    write_atomically(path, json.dumps(spec, indent=1, sort_keys=True) + "\n", mode=SPEC_MODE, sync_dir=True)
    return path


def remove_spec(cdi_dir: Path, driver: str, uid: str) -> bool:
    """Remove the claim's spec (and a temporary file a crash left); False if there was none."""
    path = spec_path(cdi_dir, driver, uid)
    with contextlib.suppress(FileNotFoundError):
        for leftover in cdi_dir.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):  # no spec, or no directory to hold one
        return False
    return True
