"""MIG placements through DRA: the placement is prepared as the MIG device that sits there, or (dynamic
partitioning) as the one created for the claim.

On the simulated a100-mig node (real Preparer, CDI specs and records on disk): the spec makes the MIG
device visible (`NVIDIA_VISIBLE_DEVICES=MIG-...`) with its GPU's device node and its GPU and compute
instances' capability nodes; nothing is capped (a MIG device's memory is its own); unprepare removes
it all, and destroys only an instance gpunode created for the claim. A placement no instance sits at
under static partitioning, a GPU not in MIG mode, a driver without the capability minors: one line
each, nothing left on disk. Dynamic partitioning and its crash points: tests/node/test_dra_mig_dynamic.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gpunode.contract import dra as names
from gpunode.errors import ClaimRefused, KubeNotFound
from gpunode.node.devices.base import Gpu
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.devices.simnode.mig import MIG_TABLES
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
    """A slice that lists every placement of every profile (more than the publisher would: a stale or
    forged slice), attributes as the publisher writes them."""
    devices = []
    for g in gpus:
        for spec in MIG_TABLES["a100-80gb"].values():
            for start in (*spec.starts, 7):  # memory slice 7 starts no placement: a placement that is none
                attrs = {
                    "uuid": {"string": g.uuid},
                    "type": {"string": "mig"},
                    "sharing": {"string": "mig"},
                    "profile": {"string": spec.name},
                    "memorySliceStart": {"int": start},
                }
                devices.append({"name": mig_device_name(g.uuid, spec.name, start), "attributes": attrs})
    spec = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE}, "devices": devices}
    return [{"metadata": {"name": f"{NODE}-{DRIVER}"}, "spec": spec}]


class MigNode:
    """The simulated a100-mig node with a Preparer over a state directory; `restart()` is a new agent
    over the same directories and GPUs."""

    def __init__(
        self,
        root: Path,
        *,
        with_device_nodes: bool = True,
        partitioning: str = "dynamic",
        backend: SimBackend | None = None,
    ) -> None:
        self.root = root
        self.backend = backend or SimBackend.from_profile("a100-mig")
        self.config = dra_config(root, mig={"partitioning": partitioning})
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.minors = root / "mig-minors"
        self.changes = 0
        self.with_device_nodes = with_device_nodes
        lines = []
        for g in self.gpus:
            for gi in range(15):
                lines.append(f"gpu{g.minor}/gi{gi}/access {100 * g.minor + gi}")
                lines.append(f"gpu{g.minor}/gi{gi}/ci0/access {1000 + 100 * g.minor + gi}")
        self.minors.write_text("config 1\nmonitor 2\n" + "\n".join(lines) + "\n")
        self.preparer = self._preparer()

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return self.backend.gpus()

    def _preparer(self) -> Preparer:
        async def fetch(ref: ClaimRef) -> dict[str, Any]:
            if (ref.namespace, ref.name) not in self.claims:
                raise KubeNotFound(f"no claim {ref.name}", status=404)
            return self.claims[(ref.namespace, ref.name)]

        async def lister() -> list[dict[str, Any]]:
            return _placements(self.gpus)

        def changed() -> None:
            self.changes += 1

        return Preparer(
            config=self.config,
            fetch_claim=fetch,
            directory=DeviceDirectory(lister, driver=DRIVER, node=NODE),
            gpus=self.backend.gpus,
            with_device_nodes=self.with_device_nodes,
            mig_minors_file=self.minors,
            mig=self.backend,
            on_mig_change=changed,
        )

    def restart(self) -> None:
        """A new agent over the same state: it recovers as the plugin does at start."""
        self.preparer = self._preparer()
        self.preparer.recover()

    def claim(self, name: str, gpu: Gpu, profile: str, start: int) -> ClaimRef:
        body = claim_body(
            name, device=mig_device_name(gpu.uuid, profile, start), memory=None, pool=NODE, share=None
        )
        self.claims[("team-a", name)] = body
        return ClaimRef("team-a", body["metadata"]["uid"], name)

    def prepare(self, ref: ClaimRef) -> Any:
        return asyncio.run(self.preparer.prepare(ref))

    def unprepare(self, ref: ClaimRef) -> None:
        asyncio.run(self.preparer.unprepare(ref))

    def instances(self, gpu: Gpu) -> dict[str, tuple[str, int | None]]:
        """MIG UUID -> (profile, first memory slice) of the GPU's instances now."""
        now = next(g for g in self.gpus if g.uuid == gpu.uuid)
        return {m.uuid: (m.profile, m.start) for m in now.mig_devices}

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
    [mig] = [m for m in gpu.mig_devices if m.start == 4 and m.gi_id == 2]  # the instance at memory slice 4
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
    assert mig.uuid in node.instances(gpu)  # an instance gpunode did not create is never destroyed
    assert node.changes == 0


def test_static_partitioning_refuses_a_placement_without_an_instance_in_one_line(tmp_path: Path) -> None:
    node = MigNode(tmp_path, partitioning="static")
    gpu = node.gpus[4]
    [half] = [m for m in gpu.mig_devices if m.start == 4]
    node.backend.destroy_mig(half.uuid)  # the operator frees memory slices 4-7
    before = node.instances(gpu)
    ref = node.claim("one", gpu, "1g.10gb", 5)
    with pytest.raises(ClaimRefused) as refused:
        node.prepare(ref)
    message = str(refused.value)
    assert "\n" not in message
    assert "1g.10gb at memory slice 5" in message and "has no such instance" in message
    assert "its instances: 3g.40gb at 0" in message and "partitioning is static" in message
    assert node.instances(gpu) == before and node.on_disk() == [] and node.changes == 0


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
    mig = next(m for m in gpu.mig_devices if m.start == 6)  # 1g.10gb at memory slice 6
    ref = node.claim("sim", gpu, "1g.10gb", 6)
    asyncio.run(node.preparer.prepare(ref))
    spec = json.loads(cdi.spec_path(node.config.dra.cdi_dir, DRIVER, ref.uid).read_text())
    assert spec["devices"][0]["containerEdits"] == {"env": [f"NVIDIA_VISIBLE_DEVICES={mig.uuid}"]}
