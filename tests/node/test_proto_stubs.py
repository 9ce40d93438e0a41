"""The committed gRPC stubs are what protos/generate.py makes, and they speak the kubelet's wire format."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2 as dp
from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from gpunode.node.kubelet._proto import podresources_v1_pb2 as pr
from gpunode.node.kubelet._proto import podresources_v1_pb2_grpc as pr_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_regenerate_identically(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a test dependency) generates the stubs")
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    assert spec and spec.loader
    generate = importlib.util.module_from_spec(spec)
    sys.modules["generate"] = generate
    spec.loader.exec_module(generate)
    written = generate.generate(tmp_path)
    committed = ROOT / "gpunode" / "node" / "kubelet" / "_proto"
    assert sorted(p.name for p in written) == sorted(
        p.name for p in committed.iterdir() if p.suffix in {".py", ".pyi"}
    )
    for path in written:
        assert path.read_text() == (committed / path.name).read_text(), (
            f"{path.name} differs: run protos/generate.py"
        )


@pytest.mark.parametrize(
    ("message", "wire"),
    [
        pytest.param(
            dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=["a"])]),
            b"\x0a\x03\x0a\x01a",
            id="AllocateRequest",
        ),
        pytest.param(
            dp.RegisterRequest(version="v1beta1", endpoint="e.sock", resource_name="x/y"),
            b"\x0a\x07v1beta1\x12\x06e.sock\x1a\x03x/y",
            id="RegisterRequest",
        ),
        pytest.param(
            dp.Device(ID="g", health="Healthy", topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=1)])),
            b"\x0a\x01g\x12\x07Healthy\x1a\x04\x0a\x02\x08\x01",
            id="Device-with-NUMA",
        ),
        pytest.param(
            dp.ContainerPreferredAllocationRequest(
                available_deviceIDs=["a"], must_include_deviceIDs=["b"], allocation_size=2
            ),
            b"\x0a\x01a\x12\x01b\x18\x02",
            id="ContainerPreferredAllocationRequest",
        ),
        pytest.param(
            dp.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
            b"\x10\x01",
            id="DevicePluginOptions",
        ),
        pytest.param(
            dp.ContainerAllocateResponse(
                mounts=[dp.Mount(container_path="/c", host_path="/h", read_only=True)]
            ),
            b"\x12\x0a\x0a\x02/c\x12\x02/h\x18\x01",
            id="ContainerAllocateResponse-mount",
        ),
        pytest.param(
            pr.ContainerDevices(resource_name="r", device_ids=["d"]),
            b"\x0a\x01r\x12\x01d",
            id="podresources-ContainerDevices",
        ),
    ],
)
def test_field_numbers_match_the_kubelet_api(message: object, wire: bytes) -> None:
    assert message.SerializeToString() == wire  # type: ignore[attr-defined]
    assert type(message).FromString(wire) == message  # type: ignore[attr-defined]


def test_method_paths_match_the_kubelet_api() -> None:
    paths = {
        name: service.full_name
        for name, service in {**dp.DESCRIPTOR.services_by_name, **pr.DESCRIPTOR.services_by_name}.items()
    }
    assert paths == {
        "Registration": "v1beta1.Registration",
        "DevicePlugin": "v1beta1.DevicePlugin",
        "PodResourcesLister": "v1.PodResourcesLister",
    }
    methods = {m.name for m in dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods}
    assert methods == {
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    }
    assert dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming
    assert hasattr(dp_grpc, "RegistrationStub") and hasattr(pr_grpc, "PodResourcesListerStub")
