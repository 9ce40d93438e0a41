"""The kubelet device-plugin API (v1beta1): one gRPC server per advertised resource.

Each resource gets its own Unix socket in the kubelet's device-plugins
directory and is registered through kubelet.sock. ListAndWatch sends the whole
device list (with health and NUMA node) at once and again on every change of
DeviceState. GetPreferredAllocation is decided by gpunode.node.allocation.preferred
(through gpunode.placement, the code the scheduler extender and the simulator
use), or by the extender itself when a pod carries its assignment
(gpunode.node.assignments, through AllocationHooks); Allocate is built by
gpunode.node.allocation.allocator, after gpunode.node.allocation.holds has made sure
no other container holds the devices (Allocates in flight, the kubelet's
pod-resources List). The kubelet
removes every socket in its directory when it restarts and re-creates
kubelet.sock; PluginManager watches for that and restarts and re-registers its
servers. This module translates errors into gRPC
status codes at its edge and does no device discovery itself: a request
that does not decode is INVALID_ARGUMENT (add_servicer wraps every method's
deserializer), and an unexpected failure is INTERNAL with one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gpunode.config.agent import Config
from gpunode.errors import AllocationError, KubeletDirError, one_line
from gpunode.node.allocation.allocator import Allocator, ContainerAllocation
from gpunode.node.allocation.holds import DeviceHolds
from gpunode.node.allocation.preferred import preferred_allocation
from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2 as pb
from gpunode.node.kubelet._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpunode.node.state import HEALTHY, UNHEALTHY, DeviceState, Snapshot

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
REGISTER_TIMEOUT_S = 5.0
SERVER_START_TIMEOUT_S = 10.0
ASYNCIO_MARGIN_S = 2.0  # asyncio bound on a gRPC await, beyond gRPC's own grace or deadline


def socket_name(resource: str) -> str:
    """gpunode-nvidia.com_gpu.sock for nvidia.com/gpu."""
    return "gpunode-" + re.sub(r"[^A-Za-z0-9_.-]", "_", resource) + ".sock"


def device_list(snapshot: Snapshot, resource: str) -> list[pb.Device]:
    """The kubelet Device messages (ID, health, NUMA node) for resource's devices."""
    out = []
    for st in snapshot.statuses(resource):
        dev = pb.Device(ID=st.device.id, health=HEALTHY if st.healthy else UNHEALTHY)
        if st.device.numa_node is not None:
            dev.topology.nodes.append(pb.NUMANode(ID=st.device.numa_node))
        out.append(dev)
    return out


@dataclass
class AllocationHooks:
    """What the plugins consult and tell around allocations; the agent fills it (empty: the node decides alone).

    assignments: gpunode.node.assignments.AssignmentBook, the cluster's GPU choices to carry out;
    allocated: called with (device IDs, "namespace/pod" or "") after each container's Allocate.
    """

    assignments: Any = None
    allocated: list[Callable[[Sequence[str], str], None]] = field(default_factory=list)


def to_response(alloc: ContainerAllocation) -> pb.ContainerAllocateResponse:
    """The ContainerAllocateResponse message for one container's allocation."""
    resp = pb.ContainerAllocateResponse(envs=alloc.envs, annotations=alloc.annotations)
    resp.mounts.extend(
        pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
        for m in alloc.mounts
    )
    resp.devices.extend(
        pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
        for d in alloc.devices
    )
    resp.cdi_devices.extend(pb.CDIDevice(name=n) for n in alloc.cdi_devices)
    return resp


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """Serves one resource from DeviceState."""

    def __init__(
        self,
        *,
        resource: str,
        state: DeviceState,
        config: Config,
        allocator: Allocator,
        hooks: AllocationHooks | None = None,
        holds: DeviceHolds | None = None,
    ) -> None:
        self.resource = resource
        self.state = state
        self.config = config
        self.allocator = allocator
        self.hooks = hooks or AllocationHooks()
        self.holds = holds or DeviceHolds(None)

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        """Plugin options: no PreStart, preferred allocation available."""
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        """Stream resource's device list to the kubelet each time it changes."""
        version = -1
        last: list[pb.Device] | None = None
        while True:
            snap = await self.state.wait_for_change(version)
            version = snap.version
            devices = device_list(snap, self.resource)
            if devices != last:
                last = devices
                yield pb.ListAndWatchResponse(devices=devices)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        """Pick preferred device IDs per container request; aborts INVALID_ARGUMENT on bad requests."""
        snap = self.state.snapshot()
        resp = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = await self._assigned(snap, creq)
            try:
                ids = ids or preferred_allocation(
                    snap,
                    self.resource,
                    list(creq.available_deviceIDs),
                    list(creq.must_include_deviceIDs),
                    creq.allocation_size,
                    replica_placement=self.config.replica_placement,
                )
            except (AllocationError, ValueError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            resp.container_responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return resp

    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateResponse:
        """Allocate the requested devices per container; aborts INVALID_ARGUMENT if refused (a device
        unknown or unhealthy, or held by another container)."""
        snap = self.state.snapshot()
        resp = pb.AllocateResponse()
        claims: list[tuple[list[str], str]] = []
        answered = False
        try:
            for creq in request.container_requests:
                ids = list(creq.devices_ids)
                try:
                    key = self.holds.claim(self.resource, ids)
                    claims.append((ids, key))
                    await self.holds.check(self.resource, ids, key)
                    alloc = await asyncio.to_thread(self.allocator.allocate, snap, self.resource, ids)
                except AllocationError as exc:
                    log.warning("Allocate refused: %s", exc)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                log.info("Allocate %s: %s", self.resource, ",".join(creq.devices_ids))
                await self._allocated(snap, ids)
                resp.container_responses.append(to_response(alloc))
            answered = True
        finally:
            for ids, key in claims:
                self.holds.release(ids, key, given=answered)
        return resp

    async def _assigned(
        self, snap: Snapshot, creq: pb.ContainerPreferredAllocationRequest
    ) -> list[str] | None:
        """The devices the cluster's assignment gives this container, or None: the node decides."""
        book = self.hooks.assignments
        if book is None:
            return None
        try:
            ids: list[str] | None = await book.prefer(
                snap,
                self.resource,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                creq.allocation_size,
                replica_placement=self.config.replica_placement,
            )
            return ids
        except Exception as exc:  # never fail a pod for the assignment's sake
            log.error("assignments: %s: %s; the node decides", type(exc).__name__, exc)
            return None

    async def _allocated(self, snap: Snapshot, device_ids: list[str]) -> None:
        """Tell the assignment book and the listeners (the node-state publisher) of one allocation."""
        holder = ""
        try:
            if self.hooks.assignments is not None:
                holder = await self.hooks.assignments.allocated(snap, self.resource, device_ids)
            for listener in self.hooks.allocated:
                listener(device_ids, holder)
        except Exception as exc:  # the allocation stands whatever the bookkeeping does
            log.error("after Allocate %s: %s: %s", self.resource, type(exc).__name__, exc)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        """No-op (PreStart is not required); returns an empty response."""
        return pb.PreStartContainerResponse()


class _Malformed:
    """What a request that does not decode deserializes to: the handler refuses it as INVALID_ARGUMENT."""

    def __init__(self, error: str) -> None:
        self.error = error


def _deserializer(message: Any) -> Callable[[bytes], Any]:
    """message.FromString, except that bytes which do not decode give a _Malformed instead of raising
    (a raising deserializer makes gRPC answer UNKNOWN and log a traceback)."""

    def deserialize(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except (DecodeError, ValueError, RecursionError) as exc:
            return _Malformed(str(exc) or type(exc).__name__)

    return deserialize


async def _refuse(name: str, request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        log.warning("%s: refused a request that does not decode: %s", name, request.error)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the request does not decode: {request.error}"
        )


async def _internal(name: str, exc: Exception, context: grpc.aio.ServicerContext) -> None:
    log.error("%s failed: %s: %s", name, type(exc).__name__, exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"{name} failed: {type(exc).__name__}")


def _guard_unary(name: str, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse(name, request, context)
        try:
            return await behaviour(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _internal(name, exc, context)

    return handler


def _guard_stream(name: str, behaviour: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse(name, request, context)
        try:
            async for item in behaviour(request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            await _internal(name, exc, context)

    return handler


def add_servicer(servicer: DevicePluginServicer, server: grpc.aio.Server) -> None:
    """Serve the DevicePlugin service from servicer, refusing undecodable requests as INVALID_ARGUMENT.

    The same methods and messages as the generated add_DevicePluginServicer_to_server; only the
    deserializers and the error edge differ.
    """
    unary = grpc.unary_unary_rpc_method_handler
    handlers: dict[str, tuple[Any, Any, Any]] = {
        "GetDevicePluginOptions": (unary, pb.Empty, pb.DevicePluginOptions),
        "ListAndWatch": (grpc.unary_stream_rpc_method_handler, pb.Empty, pb.ListAndWatchResponse),
        "GetPreferredAllocation": (unary, pb.PreferredAllocationRequest, pb.PreferredAllocationResponse),
        "Allocate": (unary, pb.AllocateRequest, pb.AllocateResponse),
        "PreStartContainer": (unary, pb.PreStartContainerRequest, pb.PreStartContainerResponse),
    }
    methods = {
        name: make(
            (_guard_stream if name == "ListAndWatch" else _guard_unary)(name, getattr(servicer, name)),
            request_deserializer=_deserializer(request),
            response_serializer=response.SerializeToString,
        )
        for name, (make, request, response) in handlers.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", methods),))


@dataclass
class PluginServer:
    """One resource's gRPC server on its Unix socket."""

    resource: str
    socket_path: Path
    servicer: DevicePluginServicer
    server: grpc.aio.Server | None = None
    inode: int | None = None

    async def start(self) -> None:
        """Start the gRPC server on a fresh Unix socket and record the socket's inode."""
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        where = self.socket_path.parent
        if not where.is_dir():  # gone while we ran (the kubelet or its mount was removed)
            raise KubeletDirError(f"the kubelet directory {where} is gone; cannot serve {self.resource}")
        server = grpc.aio.server()
        add_servicer(self.servicer, server)
        try:
            server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError as exc:  # gRPC's way of saying the address cannot be bound
            raise KubeletDirError(
                f"cannot serve {self.resource} on {self.socket_path}: {one_line(str(exc))}"
            ) from None
        async with asyncio.timeout(SERVER_START_TIMEOUT_S):  # not wait_for: it can swallow a cancellation
            await server.start()
        self.server = server
        self.inode = os.stat(self.socket_path).st_ino

    def socket_intact(self) -> bool:
        """Whether the socket file is still the one this server created."""
        try:
            return os.stat(self.socket_path).st_ino == self.inode
        except FileNotFoundError:
            return False

    async def stop(self, grace_s: float = 0.5) -> None:
        """Stop the server (waiting at most about grace_s seconds) and remove its socket if still ours."""
        if self.server is not None:
            server, self.server = self.server, None
            # gRPC's stop waits for handlers to finish; bound it at the asyncio level too, so that a
            # stream gRPC never reports finished cannot hold up a restart or the agent's exit.
            try:
                await asyncio.wait_for(server.stop(grace_s), grace_s + ASYNCIO_MARGIN_S)
            except TimeoutError:
                log.warning("the %s server did not stop within %g s; going on", self.resource, grace_s)
        if self.inode is not None and self.socket_intact():
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.inode = None


async def register(kubelet_socket: Path, server: PluginServer) -> None:
    """Register one plugin with the kubelet; raises grpc.aio.AioRpcError or TimeoutError on failure."""

    async def call() -> None:
        async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            await stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=server.socket_path.name,
                    resource_name=server.resource,
                    options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
                ),
                timeout=REGISTER_TIMEOUT_S,
            )

    # gRPC's deadline, and an asyncio one over the whole exchange (channel close included).
    await asyncio.wait_for(call(), REGISTER_TIMEOUT_S + ASYNCIO_MARGIN_S)


def _kubelet_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)


class PluginManager:
    """Runs one PluginServer per resource in DeviceState and keeps them registered with the kubelet."""

    def __init__(self, *, config: Config, state: DeviceState, allocator: Allocator | None = None) -> None:
        self.config = config
        self.state = state
        self.allocator = allocator or Allocator(config=config)
        self.hooks = AllocationHooks()  # shared by every servicer; the agent fills it
        self.holds = DeviceHolds(None)  # shared by every servicer; the agent gives it the kubelet's List
        self.servers: dict[str, PluginServer] = {}
        self.registered: dict[
            str, tuple[int, int]
        ] = {}  # resource -> kubelet.sock identity it registered with
        self.registrations = 0  # successful Register calls, for tests and metrics

    async def reconcile(self) -> None:
        """Start servers for new resources and stop those no longer advertised."""
        wanted = set(self.state.snapshot().resources())
        for resource in sorted(set(self.servers) - wanted):
            log.info("resource %s is no longer advertised; stopping its plugin", resource)
            await self.servers.pop(resource).stop()
            self.registered.pop(resource, None)
        for resource in sorted(wanted - set(self.servers)):
            servicer = DevicePluginServicer(
                resource=resource,
                state=self.state,
                config=self.config,
                allocator=self.allocator,
                hooks=self.hooks,
                holds=self.holds,
            )
            srv = PluginServer(resource, self.config.kubelet_dir / socket_name(resource), servicer)
            await srv.start()
            log.info("serving %s on %s", resource, srv.socket_path)
            self.servers[resource] = srv

    async def ensure_registered(self) -> None:
        """Register each resource with the kubelet if it is new or restarted, restarting servers whose socket vanished."""
        for resource, srv in sorted(self.servers.items()):
            if not srv.socket_intact():  # also without a kubelet: a directory that is gone must be seen
                log.info("socket of %s was removed (kubelet restart?); restarting its server", resource)
                await srv.stop()
                await srv.start()
                self.registered.pop(resource, None)
        kubelet = _kubelet_identity(self.config.kubelet_socket)
        if kubelet is None:
            return  # no kubelet yet: register when it appears
        for resource, srv in sorted(self.servers.items()):
            if self.registered.get(resource) == kubelet:
                continue
            try:
                await register(self.config.kubelet_socket, srv)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "registering %s with the kubelet failed: %s %s", resource, exc.code().name, exc.details()
                )
                continue
            except TimeoutError:
                log.warning("registering %s with the kubelet: no answer; trying again", resource)
                continue
            self.registered[resource] = kubelet
            self.registrations += 1
            log.info("registered %s with the kubelet (%s)", resource, srv.socket_path.name)

    async def run(self, *, poll_interval_s: float = 0.1, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; re-register within one poll of a kubelet restart."""
        self.config.kubelet_dir.mkdir(parents=True, exist_ok=True)
        version = -1
        try:
            await self.reconcile()
            await self.ensure_registered()
            if ready is not None:
                ready.set()
            while True:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that
                # arrives as the state changes, and the agent would then never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_interval_s):
                        snap = await self.state.wait_for_change(version)
                    version = snap.version
                    await self.reconcile()
                await self.ensure_registered()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop all plugin servers and forget their registrations."""
        for srv in self.servers.values():
            await srv.stop()
        self.servers.clear()
        self.registered.clear()
