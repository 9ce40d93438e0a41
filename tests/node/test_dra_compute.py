"""The compute share through DRA: the shared device's `compute` capacity (milli-GPU), what a claim consumed
of it read strictly, and the share prepare writes into the claim's region (asked, else proportional to
the claim's memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpunode.contract import dra as names
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.errors import ClaimRefused
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.dra.slices import build_pool, shared_device_name
from gpunode.node.memcap.compute import read_compute
from tests.node.test_metrics_collector import needs_memcap
from tests.node.test_metrics_dra import Node

GIB = 2**30


def test_the_shared_device_offers_the_whole_gpu_in_milli_gpu_and_reserves_nothing_by_default() -> None:
    gpu = SimBackend.from_profile("t4").gpus()[0]
    pool = build_pool([gpu], unit_bytes=GIB, driver_version="550.90.07")
    shared = pool.device(shared_device_name(gpu.uuid))
    assert shared is not None
    assert shared["capacity"][names.CAPACITY_COMPUTE] == {
        "value": str(MILLI_PER_GPU),
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}},
    }
    whole = pool.device(gpu.uuid.lower())
    assert whole is not None and names.CAPACITY_COMPUTE not in whole["capacity"]


@needs_memcap
@pytest.mark.parametrize(
    ("memory", "compute", "share"),
    [
        ("8Gi", "600", 600),  # asked: what the scheduler reserved
        ("8Gi", "250m", 1),  # a quantity below one milli-GPU is rounded up
        ("8Gi", "0", 100),  # asked none (the policy's default): proportional to 8 of 80 GiB
        ("8Gi", None, 100),  # an allocation from before the capacity existed: the same
    ],
)
def test_prepare_writes_the_claims_compute_share_into_its_region(
    tmp_path: Path, memory: str, compute: str | None, share: int
) -> None:
    node = Node(tmp_path)
    gpu = node.gpus[0]  # H100 80GB
    device = node.prepare("c", shared_device_name(gpu.uuid), memory, compute=compute)
    assert read_compute(node.region(device)).share_milli == share


@needs_memcap
@pytest.mark.parametrize(
    ("compute", "why"),
    [
        ("1001", "a compute share is 0 to 1000 milli-GPU"),
        ("-5", "consumedCapacity.compute: a resource quantity cannot be negative"),
        ("lots", "consumedCapacity.compute"),
    ],
)
def test_a_compute_share_out_of_range_is_refused_and_nothing_made(
    tmp_path: Path, compute: str, why: str
) -> None:
    node = Node(tmp_path)
    with pytest.raises(ClaimRefused, match=why) as refused:
        node.prepare("bad", shared_device_name(node.gpus[0].uuid), "4Gi", compute=compute)
    assert "\n" not in str(refused.value)
    state = node.config.state_dir / "dra"
    for made in (state / "memcap", state / "claims", node.config.dra.cdi_dir):
        assert not made.exists() or [p for p in made.iterdir() if not p.name.startswith(".")] == []


@needs_memcap
def test_a_share_the_container_rewrote_in_its_region_is_written_back(tmp_path: Path) -> None:
    """The region's usage file is the container's to write, its compute block included: a tenant that
    gives itself the whole GPU (or turns enforcement off) gets the claim's share back."""
    from gpunode.node.memcap.compute import DEFAULT_MODE, ComputeMode, set_compute_share

    node = Node(tmp_path)
    device = node.prepare("c", shared_device_name(node.gpus[0].uuid), "8Gi", compute="300")
    region = node.region(device)
    assert node.preparer.keep_compute_shares() == 0  # as prepared: nothing to write
    set_compute_share(region, 1000, ComputeMode.OFF)  # what the container does to its own file
    assert node.preparer.keep_compute_shares() == 1
    report = read_compute(region)
    assert (report.share_milli, report.mode) == (300, DEFAULT_MODE)


@needs_memcap
def test_the_running_plugin_writes_a_rewritten_share_back_within_seconds() -> None:
    import asyncio
    import time

    from gpunode.node.memcap.compute import ComputeMode, set_compute_share
    from tests.node.dra_world import claim, world

    async def scenario() -> None:
        async with world() as w:
            body = claim("c", device="gpu-0-shared", memory="8Gi")
            body["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["compute"] = "250"
            ref = w.api.add(body)
            resp = await w.prepare(ref)
            assert resp.claims[ref.uid].error == ""
            region = w.regions / names.claim_region_key(ref.uid)
            assert read_compute(region).share_milli == 250
            set_compute_share(region, 1000, ComputeMode.OFF)
            deadline = time.monotonic() + 10
            while read_compute(region).share_milli != 250:
                assert time.monotonic() < deadline, "the share was not written back"
                await asyncio.sleep(0.1)

    asyncio.run(asyncio.wait_for(scenario(), 30))
