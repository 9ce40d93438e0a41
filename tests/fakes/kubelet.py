"""A kubelet stand-in for the device-plugin API: Registration on a real Unix socket.

It does what the kubelet's device manager does with a plugin: accept Register
on `<dir>/kubelet.sock` (checking the API version and resource name), connect
to the plugin's own socket in the same directory, ask GetDevicePluginOptions,
keep a ListAndWatch stream open and remember the latest device list, and call
GetPreferredAllocation and Allocate on demand. restart() behaves like a kubelet
restart: the Registration server goes away, every socket in the directory is
removed (the kubelet wipes the directory on start), and kubelet.sock comes back.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc

from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2 as pb
from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

RESOURCE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


@dataclass
class PluginView:
    """What the stand-in knows about one registered plugin."""

    resource: str
    endpoint: str
    options: pb.DevicePluginOptions
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)  # ID -> health
    numa: dict[str, list[int]] = field(default_factory=dict)
    updates: int = 0  # ListAndWatch responses received
    update_times: list[float] = field(default_factory=list)  # monotonic arrival time of each response
    stream_ended: bool = False


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, owner: KubeletStandIn) -> None:
        self.owner = owner

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version!r}")
        if not RESOURCE_NAME.fullmatch(request.resource_name):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"invalid resource name {request.resource_name!r}"
            )
        endpoint = self.owner.directory / request.endpoint
        if not endpoint.exists():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no socket at {endpoint}")
        self.owner._connect(request)
        return pb.Empty()


class KubeletStandIn:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.socket = self.directory / "kubelet.sock"
        self._server: grpc.Server | None = None
        self._cond = threading.Condition()
        self.plugins: dict[str, PluginView] = {}
        self.registrations: list[tuple[float, str]] = []  # (monotonic time, resource)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> KubeletStandIn:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        if server.add_insecure_port(f"unix:{self.socket}") == 0:
            raise RuntimeError(f"cannot listen on {self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        with self._cond:
            for view in self.plugins.values():
                view.channel.close()
            self.plugins.clear()
        if self.socket.exists():
            self.socket.unlink()

    def restart(self) -> float:
        """Restart like the kubelet: drop plugins, wipe the directory's sockets, serve again. Returns the time."""
        self.stop()
        for entry in self.directory.iterdir():
            if entry.is_socket():
                entry.unlink()
        self.start()
        return time.monotonic()

    def __enter__(self) -> KubeletStandIn:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- what the device manager does ----------------------------------------------------------

    def _connect(self, request: pb.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix:{self.directory / request.endpoint}")
        stub = pb_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        view = PluginView(request.resource_name, request.endpoint, options, channel, stub)
        with self._cond:
            old = self.plugins.get(request.resource_name)
            if old is not None:
                old.channel.close()
            self.plugins[request.resource_name] = view
            self.registrations.append((time.monotonic(), request.resource_name))
            self._cond.notify_all()
        threading.Thread(target=self._watch, args=(view,), daemon=True).start()

    def _watch(self, view: PluginView) -> None:
        try:
            for resp in view.stub.ListAndWatch(pb.Empty()):
                with self._cond:
                    view.devices = {d.ID: d.health for d in resp.devices}
                    view.numa = {d.ID: [n.ID for n in d.topology.nodes] for d in resp.devices}
                    view.updates += 1
                    view.update_times.append(time.monotonic())
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        finally:
            with self._cond:
                view.stream_ended = True
                self._cond.notify_all()

    # -- test helpers --------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kubelet stand-in: timed out waiting for {what}")
                self._cond.wait(left)

    def wait_for_resources(self, names: Sequence[str], timeout: float = 10.0) -> None:
        self.wait_for(
            lambda: all(n in self.plugins and self.plugins[n].updates > 0 for n in names),
            timeout,
            f"resources {', '.join(names)} with a device list",
        )

    def devices(self, resource: str) -> dict[str, str]:
        with self._cond:
            return dict(self.plugins[resource].devices)

    def healthy(self, resource: str) -> list[str]:
        return sorted(i for i, h in self.devices(resource).items() if h == "Healthy")

    def unhealthy(self, resource: str) -> list[str]:
        return sorted(i for i, h in self.devices(resource).items() if h != "Healthy")

    def preferred(
        self, resource: str, available: Sequence[str], size: int, must_include: Sequence[str] = ()
    ) -> list[str]:
        req = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        resp = self.plugins[resource].stub.GetPreferredAllocation(req, timeout=5)
        return list(resp.container_responses[0].deviceIDs)

    def allocate(self, resource: str, device_ids: Sequence[str]) -> pb.ContainerAllocateResponse:
        req = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=list(device_ids))]
        )
        resp = self.plugins[resource].stub.Allocate(req, timeout=5)
        return resp.container_responses[0]


def short_socket_dir(prefix: str = "gn") -> Path:
    """A short directory under /tmp: Unix socket paths must stay under 108 bytes."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("GPUNODE_TEST_TMP", "/tmp")))
