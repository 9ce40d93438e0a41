"""Time-sliced GPUs through DRA: a GPU DRA serves that sharing.timeSlicing lists is published as
`<uuid>-timesliced` (allowMultipleAllocations, `replicas` claims of one replica each, uncapped) beside its
whole device; its claims are prepared uncapped; the metrics name no single holder of the shared GPU."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from gpunode.contract import dra as names
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra import cdi
from gpunode.node.dra.devices import DeviceDirectory
from gpunode.node.dra.slices import build_pool, gpu_device_name, time_sliced_device_name
from gpunode.node.kubelet.podresources import PodAttribution
from gpunode.node.metrics import MetricsCollector
from tests.fakes.podresources import Claim, Container, Pod, PodResourcesStandIn
from tests.node.test_metrics_collector import needs_memcap, scrape
from tests.node.test_metrics_dra import DRIVER, HOST, Node, kubelet  # noqa: F401  (the fixture)

GIB = 2**30


def test_a_time_sliced_gpu_offers_its_replicas_uncapped_and_no_memory_shares() -> None:
    gpus = SimBackend.from_profile("t4").gpus()
    pool = build_pool(gpus[:2], unit_bytes=GIB, time_sliced={gpus[0].uuid: 4})
    names_ = [d["name"] for d in pool.devices]
    assert names_ == [
        gpu_device_name(gpus[0].uuid),
        time_sliced_device_name(gpus[0].uuid),
        gpu_device_name(gpus[1].uuid),
        gpu_device_name(gpus[1].uuid) + "-shared",  # the other GPU is shared by memory, as before
    ]
    sliced = pool.device(time_sliced_device_name(gpus[0].uuid))
    assert sliced is not None
    assert sliced["allowMultipleAllocations"] is True
    assert sliced["attributes"][names.ATTR_SHARING] == {"string": names.SHARING_TIME_SLICED}
    assert sliced["capacity"] == {
        names.CAPACITY_REPLICAS: {
            "value": "4",
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "1"}},
        }
    }
    # it and the whole GPU take the GPU's one memory counter: a claim holds it whole or claims share it
    whole = pool.device(gpu_device_name(gpus[0].uuid))
    assert whole is not None and sliced["consumesCounters"] == whole["consumesCounters"]


def _time_sliced_node(root: Path) -> tuple[Node, str]:
    node = Node(root)
    gpu = node.gpus[0]
    pool = build_pool([gpu], unit_bytes=GIB, time_sliced={gpu.uuid: 2})
    spec = {"driver": DRIVER, "nodeName": HOST, "pool": {"name": HOST}, "devices": list(pool.devices)}

    async def lister() -> list[dict[str, Any]]:
        return [{"metadata": {"name": "s"}, "spec": spec}]

    node.preparer.directory = DeviceDirectory(lister, driver=DRIVER, node=HOST)
    return node, time_sliced_device_name(gpu.uuid)


@needs_memcap
def test_claims_of_a_time_sliced_gpu_are_prepared_uncapped(tmp_path: Path) -> None:
    node, device = _time_sliced_node(tmp_path)
    held = [node.prepare(f"ts-{i}", device, None) for i in range(2)]
    regions = node.config.state_dir / "dra" / "memcap"
    assert not regions.exists() or [p for p in regions.iterdir() if not p.name.startswith(".")] == []
    for d in held:
        parsed = names.claim_of_cdi_id(DRIVER, d.cdi_ids[0])
        assert parsed is not None
        spec = json.loads(cdi.spec_path(node.config.dra.cdi_dir, DRIVER, parsed[0]).read_text())
        assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={node.gpus[0].uuid}"]
        assert "mounts" not in spec["containerEdits"]  # no interposer: time slicing caps nothing


@needs_memcap
def test_a_gpu_two_time_sliced_claims_share_names_no_single_pod(
    tmp_path: Path,
    kubelet: PodResourcesStandIn,  # noqa: F811
) -> None:
    node, device = _time_sliced_node(tmp_path)
    a = node.prepare("ts-a", device, None)
    collector = MetricsCollector(
        backend=node.backend,
        hostname=HOST,
        attribution=PodAttribution(kubelet.socket_path, ttl_s=0.0),
        dra_driver=DRIVER,
        dra_root=node.config.state_dir / "dra",
    )
    kubelet.set_pods([Pod("team-a", "one", (Container("c", {}, (Claim("ts-a", "team-a", (a,)),)),))])
    asyncio.run(collector.collect_once())
    uuid = node.gpus[0].uuid
    assert scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", UUID=uuid).labels["pod"] == "one"  # the one holder
    b = node.prepare("ts-b", device, None)
    kubelet.set_pods(
        [
            Pod("team-a", "one", (Container("c", {}, (Claim("ts-a", "team-a", (a,)),)),)),
            Pod("team-a", "two", (Container("c", {}, (Claim("ts-b", "team-a", (b,)),)),)),
        ]
    )
    asyncio.run(collector.collect_once())
    labels = scrape(collector).one("DCGM_FI_DEV_GPU_TEMP", UUID=uuid).labels
    assert "pod" not in labels and "dra_claim_name" not in labels
