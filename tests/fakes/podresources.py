"""A kubelet pod-resources v1 stand-in served over a real Unix socket.

It answers List, Get and GetAllocatableResources from the generated stubs the
way the kubelet does: pods with their containers and, per container, the
device IDs of each resource. Tests set the pods it reports; they can also make
it fail with a gRPC status or answer slowly, to exercise the client's error
handling. It does not check anything the kubelet would check (it serves what
it is told).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from gpunode.node.kubelet._proto import podresources_v1_pb2 as pb
from gpunode.node.kubelet._proto import podresources_v1_pb2_grpc as pb_grpc
from gpunode.node.kubelet.podresources import ClaimDevice, ContainerDevices


@dataclass(frozen=True)
class Claim:
    """A DRA claim a container uses, with its devices (listed as the kubelet's dynamic_resources)."""

    name: str
    namespace: str
    devices: tuple[ClaimDevice, ...] = ()


@dataclass(frozen=True)
class Container:
    """A container and its devices: resource name -> device IDs; and its DRA claims."""

    name: str
    devices: Mapping[str, Sequence[str]] = field(default_factory=dict)
    claims: tuple[Claim, ...] = ()


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    containers: tuple[Container, ...] = ()


def pods_from_assignments(assignments: Iterable[ContainerDevices]) -> tuple[Pod, ...]:
    """Group flat (namespace, pod, container, resource, ids) records into pods, keeping their order."""
    pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
    for a in assignments:
        containers = pods.setdefault((a.namespace, a.pod), {})
        devices = containers.setdefault(a.container, {})
        devices.setdefault(a.resource_name, []).extend(a.device_ids)
    return tuple(
        Pod(
            ns,
            name,
            tuple(Container(c, {r: tuple(ids) for r, ids in devs.items()}) for c, devs in cs.items()),
        )
        for (ns, name), cs in pods.items()
    )


def _pod_message(pod: Pod) -> pb.PodResources:
    return pb.PodResources(
        name=pod.name,
        namespace=pod.namespace,
        containers=[
            pb.ContainerResources(
                name=c.name,
                # As the kubelet answers (1.21 and later): one entry per device ID.
                devices=[
                    pb.ContainerDevices(resource_name=r, device_ids=[i])
                    for r, ids in c.devices.items()
                    for i in ids
                ],
                dynamic_resources=[
                    pb.DynamicResource(
                        claim_name=claim.name,
                        claim_namespace=claim.namespace,
                        claim_resources=[
                            pb.ClaimResource(
                                cdi_devices=[pb.CDIDevice(name=i) for i in d.cdi_ids],
                                driver_name=d.driver,
                                pool_name=d.pool,
                                device_name=d.device,
                                share_id=d.share_id,
                            )
                            for d in claim.devices
                        ],
                    )
                    for claim in c.claims
                ],
            )
            for c in pod.containers
        ],
    )


class _Servicer(pb_grpc.PodResourcesListerServicer):
    def __init__(self, owner: PodResourcesStandIn) -> None:
        self._owner = owner

    def _enter(self, method: str, context: grpc.ServicerContext) -> None:
        owner = self._owner
        with owner._lock:
            owner.calls[method] = owner.calls.get(method, 0) + 1
            failure, delay_s = owner._failure, owner._delay_s
        if delay_s:
            time.sleep(delay_s)
        if failure is not None:
            context.abort(failure[0], failure[1])

    def List(
        self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.ListPodResourcesResponse:
        self._enter("List", context)
        with self._owner._lock:
            pods = self._owner._pods
        return pb.ListPodResourcesResponse(pod_resources=[_pod_message(p) for p in pods])

    def Get(
        self, request: pb.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.GetPodResourcesResponse:
        self._enter("Get", context)
        with self._owner._lock:
            pods = self._owner._pods
        for p in pods:
            if p.name == request.pod_name and p.namespace == request.pod_namespace:
                return pb.GetPodResourcesResponse(pod_resources=_pod_message(p))
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        raise AssertionError("unreachable")  # context.abort raises

    def GetAllocatableResources(
        self, request: pb.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pb.AllocatableResourcesResponse:
        self._enter("GetAllocatableResources", context)
        with self._owner._lock:
            allocatable = self._owner._allocatable
        return pb.AllocatableResourcesResponse(
            devices=[
                pb.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in allocatable.items()
            ]
        )


class PodResourcesStandIn:
    """Serves pod-resources v1 on `socket_path` until stopped.

    Use as a context manager, or call start() and stop(). set_pods() replaces
    what List reports; it accepts Pod records or flat ContainerDevices records.
    """

    def __init__(self, socket_path: str, *, max_send_message_bytes: int = 256 * 1024 * 1024) -> None:
        self.socket_path = socket_path
        self._max_send = max_send_message_bytes
        self._lock = threading.Lock()
        self._pods: tuple[Pod, ...] = ()
        self._allocatable: dict[str, tuple[str, ...]] = {}
        self._failure: tuple[grpc.StatusCode, str] | None = None
        self._delay_s = 0.0
        self._server: grpc.Server | None = None
        self.calls: dict[str, int] = {}

    def set_pods(self, pods: Iterable[Pod | ContainerDevices]) -> None:
        items = list(pods)
        flat = [p for p in items if isinstance(p, ContainerDevices)]
        grouped = [p for p in items if isinstance(p, Pod)]
        with self._lock:
            self._pods = (*grouped, *pods_from_assignments(flat))

    def set_allocatable(self, devices: Mapping[str, Sequence[str]]) -> None:
        with self._lock:
            self._allocatable = {r: tuple(ids) for r, ids in devices.items()}

    def fail_with(self, code: grpc.StatusCode | None, details: str = "injected failure") -> None:
        """Make every call fail with this status (None: answer normally again)."""
        with self._lock:
            self._failure = None if code is None else (code, details)

    def delay(self, seconds: float) -> None:
        """Answer every call only after this many seconds."""
        with self._lock:
            self._delay_s = seconds

    def call_count(self, method: str = "List") -> int:
        with self._lock:
            return self.calls.get(method, 0)

    def start(self) -> PodResourcesStandIn:
        if self._server is not None:
            raise RuntimeError("the pod-resources stand-in is already started")
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=(("grpc.max_send_message_length", self._max_send),),
        )
        pb_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise RuntimeError(f"cannot listen on unix:{self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.stop(grace=None).wait()
        self._server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> PodResourcesStandIn:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
