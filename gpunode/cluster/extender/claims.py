"""What DRA claims hold of each GPU, for the cluster side's view of the nodes.

A GPU the agent serves through DRA is published in the node-state annotation with `sharing: dra` and
nothing assigned: kube-scheduler's allocator hands it out from the node's ResourceSlice, and the agent
does not count those claims in the annotation. ClaimView counts them from the ResourceClaims'
allocations (gpunode.contract.draclaims: results of our driver, pool = the node, the device and its
consumedCapacity), and apply() gives a node's `dra` GPUs what they hold: memory taken by shares, the whole
GPU (memory and compute) by a whole-GPU claim or a MIG placement (a time-sliced replica takes neither). The extender's node cache
(NodeCache.dra) reads the nodes through it, so it sees a DRA claim's GPU as taken, as it sees a
device-plugin pod's. The queue controller charges the same allocations, read by the same parser, to the
queues of the pods holding them (queuectl/dra.py).

Fed by one list+watch of ResourceClaims through gpunode's KubeClient (run()), or by replace_all() and
claim_changed() from a caller's own watch. With a `reader`, the same watch also keeps what that reader makes
of each claim (the extender's DRA prioritize keeps the requests of claims on gpunode's DeviceClasses:
drasteer.read_claim), so a pod's claims are looked up without reading the API server. Thread safe: the extender reads from its worker threads.
Claims come from tenants: whatever a claim says is bounded by draclaims, and apply() clamps what is taken
to the GPU's memory, so no claim can make a view inconsistent or fail a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import msgspec
from lightkube.resources.resource_v1 import ResourceClaim

from gpunode.contract.dra import DEFAULT_DRIVER
from gpunode.contract.draclaims import (
    DeviceUsage,
    DeviceUse,
    claim_uses,
    gpu_device_name,
    gpu_of_device,
    shared_device_name,
    usage_of,
)
from gpunode.contract.names import Sharing
from gpunode.errors import GpunodeError
from gpunode.infra.kube import DELETED, SYNC, KubeClient
from gpunode.placement import GpuState, NodeState

log = logging.getLogger(__name__)

RETRY_S = 30.0  # after the watch is refused (no list/watch right on resourceclaims)


class ClaimView:
    """DRA usage per node (pool) and device, from the claims' allocations (see the module docstring)."""

    def __init__(
        self, driver: str = DEFAULT_DRIVER, *, reader: Callable[[Mapping[str, Any]], object] | None = None
    ) -> None:
        """`reader`: what to keep of each claim (None: nothing kept for it) besides its allocation."""
        self.driver = driver
        self.reader = reader
        self._lock = threading.Lock()
        self._uses: dict[str, list[DeviceUse]] = {}  # namespace/name -> devices of our driver it holds
        self._kept: dict[str, object] = {}  # namespace/name -> what `reader` made of the claim
        self._usage: dict[str, dict[str, DeviceUsage]] = {}  # node -> device -> usage
        self.version = 0  # moves whenever some node's usage changes
        self.synced = False
        self.problems = 0  # malformed allocation results skipped

    def _read(self, claim: Mapping[str, Any]) -> list[DeviceUse]:
        said: list[str] = []
        uses = claim_uses(claim, self.driver, said)
        if said:
            self.problems += len(said)
            log.warning("DRA claims: %s (skipped)", said[0])
        return uses

    def _keep(self, claim: Mapping[str, Any]) -> object:
        if self.reader is None:
            return None
        try:
            return self.reader(claim)
        except Exception as exc:  # a defect of the reader must not stop the watch: the claim is not kept
            self.problems += 1
            log.warning("DRA claims: a claim could not be read: %r (skipped)", exc)
            return None

    def replace_all(self, claims: Iterable[Mapping[str, Any]]) -> None:
        """A fresh list of every claim."""
        uses: dict[str, list[DeviceUse]] = {}
        kept: dict[str, object] = {}
        for claim in claims:
            mine = self._read(claim)
            if mine:
                uses[mine[0].claim] = mine
            if (k := self._keep(claim)) is not None:
                kept[_ref(claim)] = k
        with self._lock:
            self._uses = uses
            self._kept = kept
            self.synced = True
            self._recount()

    def claim_changed(self, claim: Mapping[str, Any], *, deleted: bool = False) -> None:
        """One claim added, changed or deleted."""
        ref = _ref(claim)
        mine = [] if deleted else self._read(claim)
        kept = None if deleted or not isinstance(claim, Mapping) else self._keep(claim)
        with self._lock:
            if kept is not None:
                self._kept[ref] = kept
            else:
                self._kept.pop(ref, None)
            if not mine and ref not in self._uses:
                return
            if mine:
                self._uses[ref] = mine
            else:
                self._uses.pop(ref, None)
            self._recount()

    def _recount(self) -> None:
        usage = usage_of(u for uses in self._uses.values() for u in uses)
        if _figures(usage) != _figures(self._usage):
            self.version += 1
        self._usage = usage

    def kept(self, ref: str) -> object:
        """What the reader made of claim `ref` (namespace/name); None when nothing is kept of it."""
        with self._lock:
            return self._kept.get(ref)

    def node_usage(self, node: str) -> dict[str, DeviceUsage]:
        """device -> usage on this node's pool."""
        with self._lock:
            return dict(self._usage.get(node, {}))

    def apply(self, state: NodeState) -> NodeState:
        """The node with its `dra` GPUs holding what the claims hold (the others as they are)."""
        usage = self.node_usage(state.name)
        if not usage:
            return state
        dra = [g.uuid for g in state.gpus if g.sharing == Sharing.DRA]
        taken: dict[str, tuple[int, bool]] = {}  # GPU -> (memory taken by shares, held whole)
        for device, use in usage.items():
            uuid = gpu_of_device(device, dra)
            if uuid is None:
                continue
            memory, whole = taken.get(uuid, (0, False))
            base = gpu_device_name(uuid)
            if device == shared_device_name(uuid):
                taken[uuid] = (memory + use.memory_bytes, whole)
            elif device == base or device.startswith(f"{base}-mig-"):
                taken[uuid] = (memory, True)  # the whole GPU, or a MIG placement of it
            # a time-sliced replica (`-timesliced`) takes no memory of its own: the GPU is left as it is
        if not taken:
            return state
        return replace(
            state, gpus=tuple(_held(g, *taken[g.uuid]) if g.uuid in taken else g for g in state.gpus)
        )

    async def run(self, client: KubeClient, *, retry_s: float = RETRY_S) -> None:
        """List and watch the claims through `client` (the caller's, left open) until cancelled; a refused
        watch is said once and tried again every retry_s."""
        said = False
        while True:
            try:
                async with contextlib.aclosing(client.watch(ResourceClaim)) as events:
                    async for event in events:
                        if event.type == SYNC:
                            self.replace_all([_json(o) for o in event.items])
                        elif event.object is not None:
                            self.claim_changed(_json(event.object), deleted=event.type == DELETED)
                        said = False
            except GpunodeError as exc:
                if not said:
                    log.warning(
                        "DRA claims: cannot watch ResourceClaims (%s); GPUs served through DRA are seen "
                        "without what their claims hold until it can (list and watch on resourceclaims); "
                        "trying again every %g s",
                        exc,
                        retry_s,
                    )
                    said = True
            await asyncio.sleep(retry_s)


def _ref(claim: object) -> str:
    meta = claim.get("metadata") if isinstance(claim, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"[:320]


def _held(gpu: GpuState, memory: int, whole: bool) -> GpuState:
    if whole:
        return replace(gpu, milli_free=0, memory_free_bytes=0)
    return replace(gpu, memory_free_bytes=max(0, gpu.memory_free_bytes - memory))


def _figures(usage: Mapping[str, Mapping[str, DeviceUsage]]) -> dict[str, dict[str, tuple[int, int]]]:
    return {n: {d: (u.claims, u.memory_bytes) for d, u in devices.items()} for n, devices in usage.items()}


def _json(obj: Any) -> dict[str, Any]:
    out = msgspec.to_builtins(obj)
    return out if isinstance(out, dict) else {}
