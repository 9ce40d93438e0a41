"""Client of the kubelet pod-resources API v1: which container holds which device IDs and DRA claims.

The kubelet is the source of truth for device assignment. This module asks it
(`List` over its Unix socket) and turns the answer into frozen records, and
keeps a briefly cached device-ID -> container map for the parts that label
things by pod (metrics) or act on pods (health remediation). Devices a
container holds through DRA claims (`dynamic_resources`, listed by kubelets
with the KubeletPodResourcesDynamicResources feature, on by default since
1.34) are records of their own: the claim, and per device its driver, pool,
name and CDI device IDs.

It only reads: it never changes an assignment, never talks to the API server,
and translates every gRPC failure into gpunode.errors.KubeError with a hint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import grpc
import grpc.aio

from gpunode.errors import KubeError
from gpunode.node.kubelet._proto import podresources_v1_pb2 as pb
from gpunode.node.kubelet._proto import podresources_v1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEFAULT_SOCKET_PATH = "/var/lib/kubelet/pod-resources/kubelet.sock"
# A node with thousands of pods and replicated devices answers with many
# megabytes; the gRPC default (4 MiB) would refuse it.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TTL_S = 5.0

_CLOSE_MARGIN_S = 2.0  # beyond the call's deadline, for opening and closing the channel
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    # The kubelet serves on a Unix socket; no DNS, no proxies.
    ("grpc.enable_http_proxy", 0),
)


@dataclass(frozen=True)
class ContainerDevices:
    """The device IDs of one resource that the kubelet assigned to one container."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a DRA claim as the kubelet lists it: the driver's pool and device, its CDI IDs."""

    driver: str
    pool: str
    device: str
    share_id: str | None
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class ContainerClaim:
    """A DRA ResourceClaim one container uses, with the claim's devices."""

    namespace: str
    pod: str
    container: str
    claim_name: str
    claim_namespace: str
    devices: tuple[ClaimDevice, ...]


@dataclass(frozen=True)
class PodRef:
    """The container that holds a device."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class AttributionSnapshot:
    """One answer of the kubelet, indexed by device ID.

    fetched_at_s is time.time() of the answer (seconds since the epoch).
    """

    containers: tuple[ContainerDevices, ...]
    fetched_at_s: float
    by_device: Mapping[str, PodRef] = field(default_factory=lambda: MappingProxyType({}))
    claims: tuple[ContainerClaim, ...] = ()  # the DRA claims of each container

    @classmethod
    def from_containers(
        cls,
        containers: Iterable[ContainerDevices],
        *,
        fetched_at_s: float,
        claims: Iterable[ContainerClaim] = (),
    ) -> AttributionSnapshot:
        """Index the containers by device ID (a device ID held twice keeps the first holder)."""
        items = tuple(containers)
        index: dict[str, PodRef] = {}
        for c in items:
            ref = PodRef(c.namespace, c.pod, c.container)
            for device_id in c.device_ids:
                if device_id in index and index[device_id] != ref:
                    log.warning(
                        "device %s is listed for both %s and %s; attributing it to the first",
                        device_id,
                        index[device_id],
                        ref,
                    )
                    continue
                index[device_id] = ref
        return cls(
            containers=items,
            fetched_at_s=fetched_at_s,
            by_device=MappingProxyType(index),
            claims=tuple(claims),
        )

    def owner_of(self, device_id: str) -> PodRef | None:
        """The container holding device_id in this answer, or None."""
        return self.by_device.get(device_id)


def flatten_list_response(response: pb.ListPodResourcesResponse) -> tuple[ContainerDevices, ...]:
    """Turn a List answer into one record per (container, resource); containers without devices are left out.

    The kubelet lists a container's devices of one resource as one entry per device ID (and per NUMA
    node of a device with a topology: since 1.21), so the entries of one resource are merged here, each
    device ID once, in the kubelet's order.
    """
    out: list[ContainerDevices] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            merged: dict[str, dict[str, None]] = {}
            for devices in container.devices:
                if devices.device_ids:
                    ids = merged.setdefault(devices.resource_name, {})
                    ids.update(dict.fromkeys(devices.device_ids))
            for resource_name, ids in merged.items():
                out.append(
                    ContainerDevices(
                        namespace=pod.namespace,
                        pod=pod.name,
                        container=container.name,
                        resource_name=resource_name,
                        device_ids=tuple(ids),
                    )
                )
    return tuple(out)


def flatten_claims(response: pb.ListPodResourcesResponse) -> tuple[ContainerClaim, ...]:
    """One record per (container, DRA claim) of a List answer; claims without devices are left out."""
    out: list[ContainerClaim] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for dynamic in container.dynamic_resources:
                devices = tuple(
                    ClaimDevice(
                        driver=r.driver_name,
                        pool=r.pool_name,
                        device=r.device_name,
                        share_id=r.share_id if r.HasField("share_id") else None,
                        cdi_ids=tuple(c.name for c in r.cdi_devices),
                    )
                    for r in dynamic.claim_resources
                    if r.device_name
                )
                if devices:
                    out.append(
                        ContainerClaim(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            claim_name=dynamic.claim_name,
                            claim_namespace=dynamic.claim_namespace,
                            devices=devices,
                        )
                    )
    return tuple(out)


def _check_socket(socket_path: str) -> None:
    try:
        mode = os.stat(socket_path).st_mode
    except FileNotFoundError:
        raise KubeError(
            f"the kubelet pod-resources socket {socket_path} does not exist",
            hint=(
                "mount /var/lib/kubelet/pod-resources into the agent's pod (hostPath), "
                "or set gpunode.metrics.podResourcesSocket to the kubelet's socket"
            ),
        ) from None
    except PermissionError:
        raise KubeError(
            f"no permission to reach the kubelet pod-resources socket {socket_path}",
            hint="run the agent as root or give it access to /var/lib/kubelet/pod-resources",
        ) from None
    if not stat.S_ISSOCK(mode):
        raise KubeError(
            f"{socket_path} is not a Unix socket",
            hint="point gpunode.metrics.podResourcesSocket at the kubelet's pod-resources socket (kubelet.sock)",
        )


def _translate(err: grpc.RpcError, socket_path: str, timeout_s: float) -> KubeError:
    code: grpc.StatusCode | None = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
    details = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KubeError(
            f"the kubelet did not answer pod-resources List on {socket_path} within {timeout_s:g} s",
            hint="check that the kubelet is running and healthy (systemctl status kubelet)",
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return KubeError(
            f"the kubelet pod-resources socket {socket_path} does not answer: {details}",
            hint="check that the kubelet is running; a stale socket file remains when it has stopped",
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return KubeError(
            f"the kubelet's pod-resources answer on {socket_path} is too large: {details}",
            hint=f"the answer exceeds {MAX_RECEIVE_MESSAGE_BYTES} bytes; report the node's pod count to the maintainers",
        )
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return KubeError(
            f"the kubelet on {socket_path} does not serve pod-resources v1 List: {details}",
            hint="pod-resources v1 needs Kubernetes 1.20 or later (KubeletPodResources feature)",
        )
    name = code.name if code is not None else "error"
    return KubeError(
        f"pod-resources List on {socket_path} failed ({name}): {details}",
        hint="check the kubelet's log for pod-resources errors",
    )


async def list_container_devices(
    socket_path: str = DEFAULT_SOCKET_PATH, *, timeout_s: float = 5.0
) -> tuple[ContainerDevices, ...]:
    """Ask the kubelet which container holds which device IDs (pod-resources v1 List).

    Raises KubeError when the socket is missing, the kubelet does not answer
    within timeout_s, or the call fails.
    """
    return flatten_list_response(await _list(socket_path, timeout_s))


async def list_pod_resources(
    socket_path: str = DEFAULT_SOCKET_PATH, *, timeout_s: float = 5.0
) -> tuple[tuple[ContainerDevices, ...], tuple[ContainerClaim, ...]]:
    """The device IDs and the DRA claims of every container (one pod-resources v1 List); KubeError as above."""
    response = await _list(socket_path, timeout_s)
    return flatten_list_response(response), flatten_claims(response)


async def _list(socket_path: str, timeout_s: float) -> pb.ListPodResourcesResponse:
    _check_socket(socket_path)

    async def ask() -> pb.ListPodResourcesResponse:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}", options=_CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.PodResourcesListerStub(channel)
            try:
                return await stub.List(pb.ListPodResourcesRequest(), timeout=timeout_s)
            except grpc.RpcError as err:
                raise _translate(err, socket_path, timeout_s) from None

    # gRPC's own deadline, and an asyncio one over the whole exchange (channel set-up and close
    # included), so that a completion gRPC never reports cannot stall the caller.
    try:
        return await asyncio.wait_for(ask(), timeout_s + _CLOSE_MARGIN_S)
    except TimeoutError:
        raise KubeError(
            f"the kubelet did not answer pod-resources List on {socket_path} within {timeout_s:g} s",
            hint="check that the kubelet is running and healthy (systemctl status kubelet)",
        ) from None


class PodAttribution:
    """A device-ID -> container map from the kubelet, cached for ttl_s seconds.

    `snapshot()` returns the cached answer while it is younger than ttl_s and
    asks the kubelet again otherwise; concurrent callers share one request. A
    failed refresh raises KubeError and leaves the previous answer in `last`,
    so a caller may keep labelling with slightly stale data and show its age.
    """

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET_PATH,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._monotonic = monotonic
        self._last: AttributionSnapshot | None = None
        self._last_fetch_mono: float | None = None
        self._lock: asyncio.Lock | None = None
        self.last_error: KubeError | None = None
        self.requests = 0  # calls made to the kubelet, for the agent's own metrics

    @property
    def last(self) -> AttributionSnapshot | None:
        """The last successful answer, however old (None before the first one)."""
        return self._last

    def is_fresh(self) -> bool:
        """Whether the last answer was fetched less than ttl_s seconds ago."""
        return self._last_fetch_mono is not None and self._monotonic() - self._last_fetch_mono < self.ttl_s

    async def snapshot(self) -> AttributionSnapshot:
        """The current assignment; asks the kubelet when the cached one is older than ttl_s."""
        if self._last is not None and self.is_fresh():
            return self._last
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._last is not None and self.is_fresh():
                return self._last
            return await self.refresh()

    async def refresh(self) -> AttributionSnapshot:
        """Ask the kubelet now, whatever the cache holds."""
        self.requests += 1
        try:
            containers, claims = await list_pod_resources(self.socket_path, timeout_s=self.timeout_s)
        except KubeError as err:
            self.last_error = err
            raise
        snap = AttributionSnapshot.from_containers(containers, fetched_at_s=time.time(), claims=claims)
        self._last = snap
        self._last_fetch_mono = self._monotonic()
        self.last_error = None
        return snap

    async def owner_of(self, device_id: str) -> PodRef | None:
        """The container holding device_id, or None when no container does."""
        return (await self.snapshot()).owner_of(device_id)
