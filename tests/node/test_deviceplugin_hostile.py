"""A hostile or broken gRPC peer on a device-plugin socket: every bad request is INVALID_ARGUMENT with one
log line, never UNKNOWN with a traceback, and the plugin keeps serving.

The requests are sent as raw bytes (identity serializers) over the plugin's real Unix socket, the way a
peer that does not speak protobuf, or speaks it badly, would send them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpunode.node.agent import Agent
from gpunode.node.devices.simnode.backend import SimBackend
from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2 as pb
from gpunode.node.kubelet.deviceplugin import socket_name
from tests.agentrunner import RunningAgent, make_config
from tests.fakes.kubelet import KubeletStandIn

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
SLICED = {"sharing": {"timeSlicing": {"renameByDefault": True, "resources": [{"name": GPU, "replicas": 4}]}}}

# Bytes that are no protobuf message: wire type 7, a length running past the end, a truncated varint.
MALFORMED = {
    "bad-wire-type": b"\x0f",
    "length-past-end": b"\x0a\xff\x01abc",
    "truncated-varint": b"\x08\xff\xff\xff",
}
UNARY = ("GetDevicePluginOptions", "GetPreferredAllocation", "Allocate", "PreStartContainer")


@pytest.fixture
def agent(sockdir: Path, kubelet: KubeletStandIn) -> Iterator[RunningAgent]:
    cfg = make_config(sockdir / "device-plugins", sockdir / "state", SLICED)
    ra = RunningAgent(Agent(cfg, backend=SimBackend.from_profile("t4"))).start()
    kubelet.wait_for_resources([SHARED])
    yield ra
    ra.stop()


@pytest.fixture
def channel(kubelet: KubeletStandIn, agent: RunningAgent) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"unix://{kubelet.directory / socket_name(SHARED)}") as ch:
        yield ch


def no_traceback(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], "a refused request must not log a traceback"


@pytest.mark.parametrize("method", UNARY)
@pytest.mark.parametrize("data", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_request_is_invalid_argument_without_a_traceback(
    channel: grpc.Channel,
    kubelet: KubeletStandIn,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    method: str,
    data: bytes,
) -> None:
    caplog.set_level(logging.DEBUG)
    call = channel.unary_unary(f"/v1beta1.DevicePlugin/{method}")  # no serializers: bytes as they are
    with pytest.raises(grpc.RpcError) as err:
        call(data, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "does not decode" in (err.value.details() or "")
    refusals = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(refusals) == 1 and "\n" not in refusals[0].getMessage()
    no_traceback(caplog, capfd)
    # The plugin still serves a well-formed request.
    options = pb.DevicePluginOptions.FromString(
        channel.unary_unary("/v1beta1.DevicePlugin/GetDevicePluginOptions")(b"", timeout=10)
    )
    assert options.get_preferred_allocation_available
    assert len(kubelet.healthy(SHARED)) == 16


def test_malformed_list_and_watch_is_invalid_argument(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    stream = channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch")(
        MALFORMED["bad-wire-type"], timeout=10
    )
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stream))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    no_traceback(caplog, capfd)


@pytest.mark.parametrize(
    ("must", "size", "message"),
    [
        pytest.param(13, 1, "names 13 devices but allocation_size is 1", id="must-longer-than-size"),
        pytest.param(0, 0, "allocation_size must be at least 1", id="size-zero"),
        pytest.param(0, -3, "allocation_size must be at least 1", id="size-negative"),
        pytest.param(0, 17, "17 devices asked for, only 16", id="size-over-available"),
    ],
)
def test_preferred_allocation_refusals_over_grpc(
    kubelet: KubeletStandIn,
    agent: RunningAgent,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    must: int,
    size: int,
    message: str,
) -> None:
    ids = kubelet.healthy(SHARED)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.preferred(SHARED, ids, size, ids[:must])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    no_traceback(caplog, capfd)
    assert len(kubelet.preferred(SHARED, ids, 2, ids[:1])) == 2


def test_duplicate_ids_over_grpc(kubelet: KubeletStandIn, agent: RunningAgent) -> None:
    ids = kubelet.healthy(SHARED)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.preferred(SHARED, [*ids, ids[0]], 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than once" in (err.value.details() or "")
