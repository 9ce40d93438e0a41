"""The DRA kubelet plugin: the DRAPlugin service (v1 and v1beta1), DRAResourceHealth, and registration.

Two gRPC servers on Unix sockets the kubelet dials, each created mode 0600 (the kubelet runs as
root, so no other user of the node can ask it to prepare anything):

- `<kubelet root>/plugins/<driver>/dra.sock`: DRAPlugin in both versions, served by the same
  code (gpunode.node.dra.prepare), and DRAResourceHealth's NodeWatchResources, which streams the
  health of every device of the node's slices from the health engine's verdicts (DeviceState);
- `<kubelet root>/plugins_registry/<driver>-reg.sock`: the plugin watcher's Registration
  (gpunode.node.dra.registration).

Each claim of a NodePrepareResources or NodeUnprepareResources call is handled on its own: one
that cannot be prepared gets its error (one line naming the claim and why) and the others their
devices. A request that does not decode is INVALID_ARGUMENT, an unexpected failure INTERNAL, as
for the device plugin. While running, the sockets are checked every SOCKET_CHECK_S; one that was
removed (a kubelet that cleaned its directories, an operator) is created again, so the kubelet's
plugin watcher sees the driver again and registers it anew. As often, the compute share of each
prepared claim's region is checked and written back if its container rewrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from gpunode.errors import ClaimRefused, KubeletDirError, one_line
from gpunode.node.dra.claims import ClaimRef
from gpunode.node.dra.devices import DeviceDirectory
from gpunode.node.dra.prepare import Preparer
from gpunode.node.dra.registration import RegistrationServicer
from gpunode.node.kubelet._proto import dra_v1_pb2 as v1
from gpunode.node.kubelet._proto import dra_v1beta1_pb2 as v1beta1
from gpunode.node.kubelet._proto import drahealth_v1alpha1_pb2 as hpb
from gpunode.node.kubelet._proto import pluginregistration_v1_pb2 as rpb
from gpunode.node.kubelet.deviceplugin import _deserializer, _guard_stream, _guard_unary
from gpunode.node.state import DeviceState

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600
SOCKET_CHECK_S = 1.0
ORPHAN_FIRST_CHECK_S = 60.0  # after start: the kubelet first unprepares what it knows of
ORPHAN_CHECK_S = 600.0  # then this often: prepared claims whose ResourceClaim is gone are removed
HEALTH_RESEND_S = 10.0  # the health list is sent again this often without a change
HEALTH_TIMEOUT_S = 60  # how long the kubelet keeps a device's health without hearing of it
SERVER_START_TIMEOUT_S = 10.0
MAX_CLAIMS_PER_CALL = 1024  # a pod has at most a few claims; more is not a kubelet's request


class DraServicer:
    """NodePrepareResources / NodeUnprepareResources for one API version's messages (`pb`)."""

    def __init__(self, preparer: Preparer, pb: Any) -> None:
        self.preparer = preparer
        self.pb = pb

    async def _each(self, claims: Any, one: Callable[[ClaimRef], Any]) -> list[tuple[str, Any]]:
        if len(claims) > MAX_CLAIMS_PER_CALL:
            return [
                (c.uid, ClaimRefused(f"{len(claims)} claims in one call; at most {MAX_CLAIMS_PER_CALL}"))
                for c in claims
            ]

        async def run(c: Any) -> tuple[str, Any]:
            ref = ClaimRef(c.namespace, c.uid, c.name)
            try:
                return c.uid, await one(ref)
            except ClaimRefused as exc:
                log.warning("DRA: %s", exc)
                return c.uid, exc
            except Exception as exc:  # a bug must not fail the call's other claims
                log.error("DRA: claim %s: %s: %s", ref, type(exc).__name__, exc)
                return c.uid, ClaimRefused(f"claim {ref}: internal error ({type(exc).__name__})")

        return list(await asyncio.gather(*(run(c) for c in claims)))

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Prepare every claim; each gets its CDI devices or its error."""
        resp = self.pb.NodePrepareResourcesResponse()
        for uid, outcome in await self._each(request.claims, self.preparer.prepare):
            answer = resp.claims[uid]
            if isinstance(outcome, Exception):
                answer.error = _error(outcome)
                continue
            for planned, cdi_id in zip(outcome.plan.devices, outcome.cdi_ids, strict=True):
                device = answer.devices.add(
                    request_names=[planned.request],
                    pool_name=planned.pool,
                    device_name=planned.device,
                    cdi_device_ids=[cdi_id],
                )
                if planned.share_id is not None and self.pb is v1:
                    device.share_id = planned.share_id
        return resp

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Unprepare every claim; each gets an empty error or its error."""
        resp = self.pb.NodeUnprepareResourcesResponse()
        for uid, outcome in await self._each(request.claims, self.preparer.unprepare):
            resp.claims[uid].error = _error(outcome) if isinstance(outcome, Exception) else ""
        return resp


def _error(exc: Exception) -> str:
    """The claim's error as the kubelet shows it on the pod: the problem, then what to do."""
    hint = getattr(exc, "hint", "")
    return one_line(f"{exc}; {hint}" if hint else str(exc))


class HealthServicer:
    """DRAResourceHealth: the health of every device of this node's slices, on every change."""

    def __init__(self, state: DeviceState, directory: DeviceDirectory) -> None:
        self.state = state
        self.directory = directory

    def message(self) -> hpb.NodeWatchResourcesResponse:
        """The complete list, each device healthy unless the health engine names its GPU."""
        unhealthy = self.state.snapshot().unhealthy
        now = int(time.time())
        resp = hpb.NodeWatchResourcesResponse()
        for dev in sorted(self.directory.all(), key=lambda d: (d.pool, d.name)):
            reason = unhealthy.get(dev.gpu_uuid)
            resp.devices.add(
                device=hpb.DeviceIdentifier(pool_name=dev.pool, device_name=dev.name),
                health=hpb.UNHEALTHY if reason is not None else hpb.HEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                message=(reason or "")[:1024],
            )
        return resp

    async def NodeWatchResources(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[hpb.NodeWatchResourcesResponse]:
        """Send the list now, then on every change of the health state, and every HEALTH_RESEND_S."""
        version = -1
        while True:
            if not self.directory.all():
                with contextlib.suppress(Exception):  # the slices may not be published yet
                    await self.directory.refresh()
            version = self.state.snapshot().version
            yield self.message()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEALTH_RESEND_S):
                    await self.state.wait_for_change(version)


def _handlers(service: str, methods: dict[str, tuple[Any, Any, Any, Any]]) -> Any:
    made = {
        name: make(
            (_guard_stream if make is grpc.unary_stream_rpc_method_handler else _guard_unary)(
                name, behaviour
            ),
            request_deserializer=_deserializer(request),
            response_serializer=response.SerializeToString,
        )
        for name, (make, behaviour, request, response) in methods.items()
    }
    return grpc.method_handlers_generic_handler(service, made)


def dra_handlers(preparer: Preparer, health: HealthServicer) -> list[Any]:
    """The DRAPlugin services (v1 and v1beta1) and DRAResourceHealth, with the device plugin's error edge."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    out = []
    for pb, service in (
        (v1, "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"),
        (v1beta1, "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"),
    ):
        servicer = DraServicer(preparer, pb)
        out.append(
            _handlers(
                service,
                {
                    "NodePrepareResources": (
                        unary,
                        servicer.NodePrepareResources,
                        pb.NodePrepareResourcesRequest,
                        pb.NodePrepareResourcesResponse,
                    ),
                    "NodeUnprepareResources": (
                        unary,
                        servicer.NodeUnprepareResources,
                        pb.NodeUnprepareResourcesRequest,
                        pb.NodeUnprepareResourcesResponse,
                    ),
                },
            )
        )
    # DRAResourceHealth v1 (kubelet 1.37+) has v1alpha1's messages field for field, in another package:
    # one servicer answers both, with the v1alpha1 classes (the wire format is the same).
    for service in ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"):
        out.append(
            _handlers(
                service,
                {
                    "NodeWatchResources": (
                        stream,
                        health.NodeWatchResources,
                        hpb.NodeWatchResourcesRequest,
                        hpb.NodeWatchResourcesResponse,
                    )
                },
            )
        )
    return out


def registration_handlers(servicer: RegistrationServicer) -> list[Any]:
    """The plugin watcher's Registration service."""
    unary = grpc.unary_unary_rpc_method_handler
    return [
        _handlers(
            "pluginregistration.Registration",
            {
                "GetInfo": (unary, servicer.GetInfo, rpb.InfoRequest, rpb.PluginInfo),
                "NotifyRegistrationStatus": (
                    unary,
                    servicer.NotifyRegistrationStatus,
                    rpb.RegistrationStatus,
                    rpb.RegistrationStatusResponse,
                ),
            },
        )
    ]


class SocketServer:
    """One gRPC server on a Unix socket of mode 0600, started again if its socket disappears."""

    def __init__(self, path: Path, handlers: list[Any], what: str) -> None:
        self.path = path
        self.handlers = handlers
        self.what = what
        self.server: grpc.aio.Server | None = None
        self.inode: int | None = None

    async def start(self) -> None:
        """Serve on a fresh socket (its directory created 0750 if missing), then set it to 0600."""
        self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(tuple(self.handlers))
        try:
            server.add_insecure_port(f"unix://{self.path}")  # binds the socket now
        except RuntimeError as exc:
            raise KubeletDirError(
                f"cannot serve the {self.what} on {self.path}: {one_line(str(exc))}"
            ) from None
        # 0600 before anything is served; the directory (0750, root's) keeps others out meanwhile.
        os.chmod(self.path, SOCKET_MODE)
        async with asyncio.timeout(SERVER_START_TIMEOUT_S):
            await server.start()
        self.server = server
        self.inode = os.stat(self.path).st_ino

    def intact(self) -> bool:
        """Whether the socket file is still the one this server made."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    async def stop(self, grace_s: float = 0.5) -> None:
        """Stop serving and remove the socket if it is still ours."""
        if self.server is not None:
            server, self.server = self.server, None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.stop(grace_s), grace_s + 2.0)
        if self.inode is not None and self.intact():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.inode = None


class DraPlugin:
    """The kubelet plugin of one driver: recovers the claims, serves both sockets, keeps them there."""

    def __init__(
        self,
        *,
        preparer: Preparer,
        state: DeviceState,
        registration_socket: Path,
        service_socket: Path,
    ) -> None:
        self.preparer = preparer
        self.health = HealthServicer(state, preparer.directory)
        self.registration = RegistrationServicer(preparer.driver, service_socket)
        self.service = SocketServer(service_socket, dra_handlers(preparer, self.health), "DRA plugin service")
        self.registrar = SocketServer(
            registration_socket, registration_handlers(self.registration), "DRA plugin registration"
        )
        self.restarts = 0  # sockets made again after they vanished

    async def start(self) -> None:
        """Roll back claims left mid-prepare, then serve the DRA service and, last, registration."""
        rolled, kept = await asyncio.to_thread(self.preparer.recover)
        log.info("DRA: %d prepared claim(s) kept, %d rolled back", kept, rolled)
        with contextlib.suppress(Exception):  # the slices may not be published yet; looked up on demand
            await self.preparer.directory.refresh()
        await self.service.start()
        await self.registrar.start()  # the kubelet dials the service as soon as it sees this socket
        log.info(
            "DRA: driver %s serving on %s, registration on %s",
            self.preparer.driver,
            self.service.path,
            self.registrar.path,
        )

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; make a vanished socket again within SOCKET_CHECK_S."""
        try:
            await self.start()
            if ready is not None:
                ready.set()
            next_orphan_check = time.monotonic() + ORPHAN_FIRST_CHECK_S
            while True:
                await asyncio.sleep(SOCKET_CHECK_S)
                try:  # a share a container rewrote in its region is written back within a second
                    await asyncio.to_thread(self.preparer.keep_compute_shares)
                except Exception as exc:  # tried again at the next check
                    log.warning("DRA: checking the claims' compute shares failed: %s", exc)
                if time.monotonic() >= next_orphan_check:
                    next_orphan_check = time.monotonic() + ORPHAN_CHECK_S
                    try:
                        await self.preparer.collect_orphans()
                    except Exception as exc:  # a failed check is tried again at the next one
                        log.warning("DRA: checking for claims gone from the API server failed: %s", exc)
                for srv in (self.service, self.registrar):
                    if not srv.intact():
                        log.info("DRA: the socket %s was removed; serving on a new one", srv.path)
                        await srv.stop()
                        await srv.start()
                        self.restarts += 1
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop both servers: registration first, so the kubelet stops dialing the service."""
        await self.registrar.stop()
        await self.service.stop()
