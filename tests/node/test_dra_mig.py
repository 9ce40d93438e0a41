"""MIG placements through DRA: the allocated placement is prepared as the MIG device that sits there.

On the simulated a100-mig node (real Preparer, CDI specs and records on disk): the spec makes the MIG
device visible (`NVIDIA_VISIBLE_DEVICES=MIG-...`) with its GPU's device node and its GPU and compute
instances' capability nodes; nothing is capped (a MIG device's memory is its own); unprepare removes
it all. A placement no instance sits at, a GPU not in MIG mode, a driver without the capability
minors: one line each, nothing left on disk.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gpunode.contract import dra as names
from gpunode.errors import ClaimRefused
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra import cdi
from gpunode.node.dra.claims import ClaimRef
from gpunode.node.dra.devices import DeviceDirectory
from gpunode.node.dra.prepare import Preparer
from gpunode.node.dra.slices import mig_device_name
from tests.node.dra_world import claim as claim_body
from tests.node.dra_world import dra_config

NODE = "node-a"
DRIVER = names.DEFAULT_DRIVER


def _placements(gpus: tuple[Gpu, ...]) -> list[dict[str, Any]]:
    """The slice's MIG placements (those the tests name), attributes as the publisher writes them."""
    devices = []
    for g in gpus:
        for profile, start in (
            ("1g.10gb", 0),
            ("1g.10gb", 6),
            ("3g.40gb", 0),
            ("3g.40gb", 4),
            ("7g.80gb", 0),
        ):
            attrs = {
                "uuid": {"string": g.uuid},
                "type": {"string": "mig"},
                "sharing": {"string": "mig"},
                "profile": {"string": profile},
                "memorySliceStart": {"int": start},
            }
            devices.append({"name": mig_device_name(g.uuid, profile, start), "attributes": attrs})
    spec = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE}, "devices": devices}
    return [{"metadata": {"name": f"{NODE}-{DRIVER}"}, "spec": spec}]


class MigNode:
    def __init__(self, root: Path, *, with_device_nodes: bool = True) -> None:
        self.backend = SimBackend.from_profile("a100-mig")
        self.gpus = self.backend.gpus()
        self.config = dra_config(root)
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.minors = root / "mig-minors"
        lines = []
        for g in self.gpus:
            for m in g.mig_devices:
                lines.append(f"gpu{g.minor}/gi{m.gi_id}/access {100 * g.minor + m.gi_id}")
                lines.append(f"gpu{g.minor}/gi{m.gi_id}/ci{m.ci_id}/access {1000 + 100 * g.minor + m.gi_id}")
        self.minors.write_text("config 1\nmonitor 2\n" + "\n".join(lines) + "\n")

        async def fetch(ref: ClaimRef) -> dict[str, Any]:
            return self.claims[(ref.namespace, ref.name)]

        async def lister() -> list[dict[str, Any]]:
            return _placements(self.gpus)

        self.preparer = Preparer(
            config=self.config,
            fetch_claim=fetch,
            directory=DeviceDirectory(lister, driver=DRIVER, node=NODE),
            gpus=lambda: self.gpus,
            with_device_nodes=with_device_nodes,
            mig_minors_file=self.minors,
        )

    def claim(self, name: str, gpu: Gpu, profile: str, start: int) -> ClaimRef:
        body = claim_body(
            name, device=mig_device_name(gpu.uuid, profile, start), memory=None, pool=NODE, share=None
        )
        self.claims[("team-a", name)] = body
        return ClaimRef("team-a", body["metadata"]["uid"], name)

    def on_disk(self) -> list[str]:
        state = self.config.state_dir / "dra"
        found = (
            [p.name for p in self.config.dra.cdi_dir.glob("*.json")]
            if self.config.dra.cdi_dir.exists()
            else []
        )
        for sub in ("memcap", "claims"):
            if (state / sub).exists():
                found += [p.name for p in (state / sub).iterdir() if not p.name.startswith(".")]
        return found


def test_a_placement_is_prepared_as_the_mig_device_that_sits_there(tmp_path: Path) -> None:
    node = MigNode(tmp_path)
    gpu = node.gpus[4]  # 3g.40gb at 0 and at 4
    [mig] = [m for m in gpu.mig_devices if m.gi_id == 2]  # the instance at memory slice 4
    ref = node.claim("mig", gpu, "3g.40gb", 4)
    prepared = asyncio.run(node.preparer.prepare(ref))
    assert prepared.plan.devices[0].mig_uuid == mig.uuid
    spec = json.loads(cdi.spec_path(node.config.dra.cdi_dir, DRIVER, ref.uid).read_text())
    [device] = spec["devices"]
    assert device["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"]
    assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"]
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
        f"/dev/nvidia{gpu.minor}",
        f"/dev/nvidia-caps/nvidia-cap{100 * gpu.minor + 2}",
        f"/dev/nvidia-caps/nvidia-cap{1000 + 100 * gpu.minor + 2}",
    ]
    assert "mounts" not in spec["containerEdits"]  # no interposer: the instance's memory is its own
    assert not (node.config.state_dir / "dra" / "memcap" / names.claim_region_key(ref.uid)).exists()
    # Prepared twice: the same answer from the record, nothing made again.
    assert asyncio.run(node.preparer.prepare(ref)).cdi_ids == prepared.cdi_ids
    asyncio.run(node.preparer.unprepare(ref))
    assert node.on_disk() == []


def test_a_placement_without_an_instance_is_refused_in_one_line(tmp_path: Path) -> None:
    node = MigNode(tmp_path)
    ref = node.claim("whole", node.gpus[0], "7g.80gb", 0)  # GPU 0 is seven 1g.10gb instances
    with pytest.raises(ClaimRefused) as refused:
        asyncio.run(node.preparer.prepare(ref))
    message = str(refused.value)
    assert "\n" not in message
    assert "7g.80gb at memory slice 0" in message and "has no such instance" in message
    assert "its instances: 1g.10gb at 0, 1g.10gb at 1" in message
    assert "does not create MIG instances" in refused.value.hint
    assert node.on_disk() == []


def test_a_placement_on_a_gpu_not_in_mig_mode_is_refused(tmp_path: Path) -> None:
    node = MigNode(tmp_path)
    plain = next(g for g in node.gpus if not g.mig_enabled)
    with pytest.raises(ClaimRefused, match="is not in MIG mode"):
        asyncio.run(node.preparer.prepare(node.claim("plain", plain, "1g.10gb", 0)))
    assert node.on_disk() == []


def test_without_the_drivers_capability_minors_nothing_is_half_prepared(tmp_path: Path) -> None:
    node = MigNode(tmp_path)
    node.minors.write_text("config 1\n")  # a driver that lists no MIG capability
    with pytest.raises(ClaimRefused, match="no MIG capability minor for gpu0/gi7/access"):
        asyncio.run(node.preparer.prepare(node.claim("nocaps", node.gpus[0], "1g.10gb", 0)))
    assert node.on_disk() == []


def test_the_simulated_node_prepares_without_device_nodes(tmp_path: Path) -> None:
    node = MigNode(tmp_path, with_device_nodes=False)
    gpu = node.gpus[0]
    mig = next(m for m in gpu.mig_devices if m.gi_id == 13)  # 1g.10gb at memory slice 6
    ref = node.claim("sim", gpu, "1g.10gb", 6)
    asyncio.run(node.preparer.prepare(ref))
    spec = json.loads(cdi.spec_path(node.config.dra.cdi_dir, DRIVER, ref.uid).read_text())
    assert spec["devices"][0]["containerEdits"] == {"env": [f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"]}
