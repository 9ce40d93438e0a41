"""Creating and destroying MIG instances: the simulated node, and the NVML calls against a fake pynvml.

The NVML fake answers the calls gpunode.node.devices.nvml.partition makes, records them, and fails
the one a test names with an NVML error code, so the order of the calls, the rollback of a GPU
instance whose compute instance cannot be made, and the errors (never swallowed as "absent", even
NO_PERMISSION) are checked without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.config.dra import parse_dra_config
from gpunode.errors import BackendError, ConfigError, DeviceNotFound, SimFaultError
from gpunode.node.devices.base import MigPartitioner
from gpunode.node.devices.nvml import partition
from gpunode.node.devices.nvml.backend import NvmlBackend
from gpunode.node.devices.nvml.discovery import placement_start
from gpunode.node.devices.nvml.query import NvmlQuery
from gpunode.node.devices.simnode.backend import SimBackend


def freed_gpu4() -> tuple[SimBackend, str, str]:
    backend = SimBackend.from_profile("a100-mig")
    gpu = backend.gpus()[4]
    [half] = [m for m in gpu.mig_devices if m.start == 4]
    backend.destroy_mig(half.uuid)
    return backend, gpu.uuid, half.uuid


def test_both_backends_are_mig_partitioners() -> None:
    assert isinstance(SimBackend.from_profile("a100-mig"), MigPartitioner)
    assert issubclass(NvmlBackend, MigPartitioner)


def test_the_simulated_node_creates_at_the_placement_and_destroys() -> None:
    backend, gpu, old = freed_gpu4()
    new = backend.create_mig(gpu, "3g.40gb", 4)
    assert new != old  # a new UUID for every creation, as NVML gives
    mig = backend.gpus()[4].mig_by_uuid(new)
    assert mig is not None and (mig.profile, mig.start, mig.gi_id, mig.ci_id, mig.slices) == (
        "3g.40gb",
        4,
        2,
        0,
        3,
    )
    backend.add_process(gpu, 4242, 2**30, mig_uuid=new)  # a process runs on it
    with pytest.raises(SimFaultError, match="in use by process"):
        backend.destroy_mig(new)
    backend.remove_process(4242)
    backend.destroy_mig(new)
    assert backend.gpus()[4].mig_by_uuid(new) is None
    with pytest.raises(DeviceNotFound):
        backend.destroy_mig(new)


@pytest.mark.parametrize(
    ("profile", "start", "why"),
    [
        ("1g.10gb", 2, "overlaps MIG device"),  # the 3g.40gb at 0
        ("3g.40gb", 2, "cannot start at memory slice 2"),
        ("5g.50gb", 4, "is not a MIG profile"),
    ],
)
def test_the_simulated_node_refuses_what_nvml_would(profile: str, start: int, why: str) -> None:
    backend, gpu, _ = freed_gpu4()
    before = backend.gpus()[4].mig_devices
    with pytest.raises(SimFaultError, match=why) as refused:
        backend.create_mig(gpu, profile, start)
    assert "\n" not in str(refused.value)
    assert backend.gpus()[4].mig_devices == before


def test_the_simulated_node_refuses_a_gpu_not_in_mig_mode() -> None:
    backend = SimBackend.from_profile("a100-mig")
    plain = backend.gpus()[7]
    with pytest.raises(SimFaultError, match="is not in MIG mode"):
        backend.create_mig(plain.uuid, "1g.10gb", 0)


def test_the_partitioning_setting() -> None:
    assert parse_dra_config({}, "gpunode.dra").mig_partitioning == "dynamic"
    assert parse_dra_config({"mig": {"partitioning": "static"}}, "gpunode.dra").mig_dynamic is False
    for bad, why in (
        ({"mig": {"partitioning": "auto"}}, "expected one of dynamic, static"),
        ({"mig": {"partition": "static"}}, "unknown key partition"),
        ({"mig": None}, "present but empty"),
    ):
        with pytest.raises(ConfigError, match=why):
            parse_dra_config(bad, "gpunode.dra")


# -- NVML -------------------------------------------------------------------------------------------------


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakePartitionNvml:
    """What partition.py calls of pynvml, for one A100 80GB: two GI profiles and their CI profiles."""

    NVMLError = NVMLError
    NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
    NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 9
    NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0
    NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 2

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[tuple[Any, ...]] = []

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise NVMLError(self.fail[name])

    def c_nvmlGpuInstancePlacement_t(self) -> Any:
        return Obj(start=None, size=None)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: Any, profile: int) -> Any:
        self._call("profileInfo", profile)
        return {
            0: Obj(id=19, sliceCount=1, memorySizeMB=9856),
            9: Obj(id=15, sliceCount=1, memorySizeMB=19968),
            2: Obj(id=9, sliceCount=3, memorySizeMB=40192),
        }[profile]

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h: Any, profile_id: int, placement: Any) -> Any:
        self._call("createGI", profile_id, placement.start, placement.size)
        return "gi-handle"

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> Any:
        return Obj(id=2)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: Any, profile: int, engine: int) -> Any:
        self._call("ciProfileInfo", profile, engine)
        return Obj(id=profile + 100)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, profile_id: int) -> Any:
        self._call("createCI", profile_id)
        return "ci-handle"

    def nvmlComputeInstanceGetInfo(self, ci: Any) -> Any:
        return Obj(id=0)

    def nvmlGpuInstanceDestroy(self, gi: Any) -> None:
        self._call("destroyGI", gi)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        if uuid != "MIG-1":
            raise NVMLError(2)  # INVALID_ARGUMENT: no such device
        return "mig-handle"

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, mh: Any) -> Any:
        return "gpu-handle"

    def nvmlDeviceGetGpuInstanceId(self, mh: Any) -> int:
        return 2

    def nvmlDeviceGetComputeInstanceId(self, mh: Any) -> int:
        return 0

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi_id: int) -> Any:
        return "gi-handle"

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: Any, ci_id: int) -> Any:
        return "ci-handle"

    def nvmlComputeInstanceDestroy(self, ci: Any) -> None:
        self._call("destroyCI", ci)


def test_nvml_creates_the_gpu_instance_at_the_placement_then_its_compute_instance() -> None:
    nv = FakePartitionNvml()
    assert partition.create(NvmlQuery(nv), "gpu-handle", "GPU-a", "a100-80gb", "3g.40gb", 4) == (2, 0)
    made = [c for c in nv.calls if c[0] in ("createGI", "ciProfileInfo", "createCI")]
    assert made == [("createGI", 9, 4, 4), ("ciProfileInfo", 2, 0), ("createCI", 102)]


def test_nvml_picks_the_profile_by_memory_among_those_of_one_slice() -> None:
    nv = FakePartitionNvml()
    partition.create(NvmlQuery(nv), "gpu-handle", "GPU-a", "a100-80gb", "1g.20gb", 6)
    assert ("createGI", 15, 6, 2) in nv.calls


def test_nvml_destroys_the_gpu_instance_when_its_compute_instance_fails() -> None:
    nv = FakePartitionNvml(fail={"createCI": 4})  # NO_PERMISSION: an error here, never "absent"
    with pytest.raises(BackendError, match="nvmlGpuInstanceCreateComputeInstance failed") as refused:
        partition.create(NvmlQuery(nv), "gpu-handle", "GPU-a", "a100-80gb", "3g.40gb", 0)
    assert "\n" not in str(refused.value)
    assert nv.calls[-1] == ("destroyGI", "gi-handle")


def test_nvml_refusals_are_one_line_errors() -> None:
    nv = FakePartitionNvml(fail={"createGI": 3})  # NOT_SUPPORTED (for reading calls: "absent")
    with pytest.raises(BackendError, match=r"GPU GPU-a: creating MIG instance 3g\.40gb at memory slice 4"):
        partition.create(NvmlQuery(nv), "gpu-handle", "GPU-a", "a100-80gb", "3g.40gb", 4)
    with pytest.raises(BackendError, match=r"NVML offers no GPU instance profile like 7g\.80gb"):
        partition.create(NvmlQuery(FakePartitionNvml()), "gpu-handle", "GPU-a", "a100-80gb", "7g.80gb", 0)


def test_nvml_destroys_the_compute_instance_then_the_gpu_instance() -> None:
    nv = FakePartitionNvml()
    partition.destroy(NvmlQuery(nv), "MIG-1")
    assert [c[0] for c in nv.calls] == ["destroyCI", "destroyGI"]
    with pytest.raises(DeviceNotFound, match="MIG-2"):
        partition.destroy(NvmlQuery(nv), "MIG-2")
    busy = FakePartitionNvml(fail={"destroyGI": 19})  # IN_USE
    with pytest.raises(BackendError, match="destroying MIG device MIG-1: nvmlGpuInstanceDestroy failed"):
        partition.destroy(NvmlQuery(busy), "MIG-1")


class FakeDiscoveryNvml:
    """nvmlDeviceGetGpuInstanceById and nvmlGpuInstanceGetInfo as discovery reads a placement."""

    NVMLError = NVMLError

    def __init__(self, starts: dict[int, int]) -> None:
        self.starts = starts

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi_id: int) -> Any:
        if gi_id not in self.starts:
            raise NVMLError(2)  # INVALID_ARGUMENT: no such GPU instance
        return gi_id

    def nvmlGpuInstanceGetInfo(self, gi: int) -> Any:
        return Obj(id=gi, placement=Obj(start=self.starts[gi], size=1))


def test_discovery_reads_the_placement_nvml_gives_not_one_guessed_from_the_instance_id() -> None:
    """The driver numbers GPU instances in its own order: GPU instance 9 may sit at memory slice 0."""
    q = NvmlQuery(FakeDiscoveryNvml({9: 0, 7: 3}))
    assert placement_start(q, "gpu-handle", 9, "GPU-a") == 0
    assert placement_start(q, "gpu-handle", 7, "GPU-a") == 3
    assert placement_start(q, "gpu-handle", 11, "GPU-a") is None  # NVML cannot say: None, not a guess
    assert placement_start(NvmlQuery(Obj(NVMLError=NVMLError)), "gpu-handle", 9, "GPU-a") is None
