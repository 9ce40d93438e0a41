"""The node choice for pods whose ResourceClaims ask gpunode's DRA devices: what prioritize-claims scores.

kube-scheduler's DRA allocator picks the device on a node (first fit over the order the agent gives its
slice, gpunode.node.dra.order); the node is kube-scheduler's own choice, and it calls the extender's
filter and prioritize only for pods asking its managed resources. A second extender entry (prioritizeVerb
`prioritize-claims`, no managedResources, so it is called for every pod, ignorable) ranks the nodes for
pods that name ResourceClaims, by the same placement policy the device-plugin pods are placed by:

- pod_claim_refs(): the pod's claims (spec.resourceClaims: a claim by name, or the one made from a template,
  found in status.resourceClaimStatuses), always in the pod's own namespace; None for a pod that names none
  (the fast path: no lookup at all);
- the claims' requests come from the ClaimView's watch (read_claim keeps, per claim, its requests on
  gpunode's DeviceClasses, read by the queue controller's bounded reader, gpunode.cluster.queuectl.dra);
- claim_request(): one placement Request for the pod: whole GPUs (the sum of the counts asked of the whole
  class), else a share of the largest memory asked of the shared class, rounded up to the memory unit as
  the allocator does. MIG placements and time-sliced replicas are not steered: the node-state annotation
  does not say which placements of a DRA GPU are free, nor which GPUs are time-sliced;
- dra_state(): the node as placement sees its DRA GPUs (what their claims hold, ClaimView.apply), each
  taking shares and whole requests as the agent publishes them (a shared device and a whole device per
  GPU, excluding each other).

Pods come in bursts: kube-scheduler asks for the next pod before the claims of the last one are allocated
and the ClaimView has seen them. So each answer is remembered as assumed (Assumed): the request on the GPUs
the policy chose on the node it ranked first, counted in the other pods' node views until the ClaimView sees
one of the pod's claims allocated (the allocation counts from then on), the pod is ranked again (its newer
answer replaces it) or ASSUMED_TTL_S passes (a pod kube-scheduler put elsewhere, or could not place). At most
MAX_ASSUMED are kept (the oldest go first), and only for pods whose claims exist and ask something.

Claims come from tenants: a claim with a problem (an unreadable request list, a share without memory,
allocationMode All), a claim already allocated (the allocator keeps it where it is) and a claim reserved
for other pods add nothing to the request; a pod whose claims add nothing is not scored (an empty answer:
kube-scheduler adds nothing). Pure functions; no I/O.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpunode.cluster.queuectl.dra import MAX_CLAIMS, DraClaim
from gpunode.cluster.queuectl.dra import read_claim as read_dra_claim
from gpunode.contract.dra import CLASS_SHARED, CLASS_WHOLE
from gpunode.contract.names import Sharing
from gpunode.placement import NodeState, Request

__all__ = [
    "ASSUMED_TTL_S",
    "MAX_ASSUMED",
    "Assumed",
    "Assumption",
    "DraClaim",
    "claim_request",
    "dra_state",
    "names_claims",
    "pod_claim_refs",
    "read_claim",
    "with_assumed",
]

MAX_GPUS = 1024  # whole GPUs one pod's claims may ask, as pods.MAX_GPUS for device-plugin pods
ASSUMED_TTL_S = 30.0  # an answer counts this long at most before its claims are seen allocated
MAX_ASSUMED = 4096  # answers remembered at once (a burst of pods being scheduled)


def read_claim(driver: str) -> Callable[[Mapping[str, Any]], DraClaim | None]:
    """What the ClaimView keeps of a claim for prioritize-claims: its DraClaim when it asks something of
    gpunode's DeviceClasses (or says why it cannot be read), else None (nothing kept)."""

    def read(claim: Mapping[str, Any]) -> DraClaim | None:
        kept = read_dra_claim(claim, driver)
        return kept if kept is not None and (kept.asks or kept.problem) else None

    return read


def names_claims(pod: Mapping[str, Any]) -> bool:
    """Whether the pod names ResourceClaims at all (cheap: one look at spec.resourceClaims)."""
    spec = pod.get("spec")
    claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    return isinstance(claims, list) and bool(claims)


def pod_claim_refs(pod: Mapping[str, Any]) -> tuple[str, ...] | None:
    """namespace/name of the pod's claims that exist (bounded by MAX_CLAIMS), None when it names none."""
    if not names_claims(pod):
        return None
    meta, spec, status = pod.get("metadata"), pod.get("spec"), pod.get("status")
    meta = meta if isinstance(meta, Mapping) else {}
    status = status if isinstance(status, Mapping) else {}
    ns = meta.get("namespace") or "default"
    if not isinstance(ns, str) or len(ns) > 63:
        return ()
    made: dict[object, object] = {}
    statuses = status.get("resourceClaimStatuses")
    for s in statuses[:MAX_CLAIMS] if isinstance(statuses, list) else ():
        if isinstance(s, Mapping) and isinstance(s.get("name"), str):
            made[s["name"]] = s.get("resourceClaimName")
    assert isinstance(spec, Mapping)
    refs: list[str] = []
    for c in spec["resourceClaims"][:MAX_CLAIMS]:
        if not isinstance(c, Mapping):
            continue
        name = c.get("resourceClaimName")
        if name is None and c.get("resourceClaimTemplateName") is not None:
            name = made.get(c.get("name"))
        if isinstance(name, str) and 0 < len(name) <= 253:
            refs.append(f"{ns}/{name}")  # a pod's claims are in its own namespace, never another's
    return tuple(dict.fromkeys(refs))


def claim_request(claims: list[object], *, pod_uid: str, memory_unit_bytes: int) -> Request | None:
    """The placement Request the pod's claims (ClaimView.kept: DraClaim or None) make, or None when they
    ask nothing this scoring steers (see the module docstring)."""
    whole = 0
    shares: list[int] = []
    for claim in claims:
        if not isinstance(claim, DraClaim) or claim.problem or claim.allocated:
            continue
        if claim.reserved and pod_uid not in claim.reserved:
            continue  # another pod's claim: it must not steer this one
        for ask in claim.asks:
            if ask.kind == CLASS_WHOLE:
                whole += ask.count
            elif ask.kind == CLASS_SHARED and ask.memory_bytes:
                shares.append(ask.memory_bytes)
    if whole:
        return Request(gpus=min(whole, MAX_GPUS))
    if shares:
        unit = max(1, memory_unit_bytes)
        return Request(gpu_memory_bytes=-(-max(shares) // unit) * unit)
    return None


def dra_state(state: NodeState) -> NodeState | None:
    """The node with only its GPUs served through DRA, each taking shares and whole requests (None: it has
    none). What their claims hold is already in `state` (NodeCache applies the ClaimView)."""
    gpus = tuple(
        replace(g, sharing=Sharing.FRACTIONAL, serves_whole=True)
        for g in state.gpus
        if g.sharing == Sharing.DRA
    )
    if not gpus:
        return None
    kept = {g.uuid for g in gpus}
    gpus = tuple(replace(g, nvlink_peers=g.nvlink_peers & kept) for g in gpus)
    return replace(state, gpus=gpus)


@dataclass(frozen=True)
class Assumption:
    """What one answer assumed: the pod's request on these GPUs of this node, until its claims are allocated."""

    node: str
    gpus: tuple[str, ...]
    request: Request
    claims: tuple[str, ...]  # namespace/name of the claims that made the request
    until: float


class Assumed:
    """The answers of prioritize-claims whose claims are not allocated yet (see the module docstring)."""

    def __init__(
        self,
        *,
        ttl_s: float = ASSUMED_TTL_S,
        limit: int = MAX_ASSUMED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._clock = clock
        self._lock = threading.Lock()
        self._by_pod: OrderedDict[str, Assumption] = OrderedDict()  # pod UID -> its last answer, oldest first

    def assume(
        self, pod_uid: str, node: str, gpus: tuple[str, ...], request: Request, claims: Iterable[str]
    ) -> None:
        """Remember the pod's answer (replacing its earlier one)."""
        with self._lock:
            self._by_pod.pop(pod_uid, None)
            self._by_pod[pod_uid] = Assumption(node, gpus, request, tuple(claims), self._clock() + self.ttl_s)
            while len(self._by_pod) > self.limit:
                self._by_pod.popitem(last=False)

    def live(self, allocated: Callable[[str], bool], *, skip_pod: str) -> list[Assumption]:
        """The answers still to count (not this pod's); those whose claims are allocated, or that are too
        old, are dropped."""
        now = self._clock()
        with self._lock:
            for uid, a in list(self._by_pod.items()):
                if a.until < now or any(allocated(c) for c in a.claims):
                    del self._by_pod[uid]
            return [a for uid, a in self._by_pod.items() if uid != skip_pod]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_pod)


def with_assumed(state: NodeState, assumed: Iterable[Assumption]) -> NodeState:
    """The node (dra_state's) with the assumed answers on it taken: a whole GPU all, a share its memory."""
    taken: dict[str, tuple[int, bool]] = {}
    for a in assumed:
        if a.node != state.name:
            continue
        for uuid in a.gpus:
            memory, whole = taken.get(uuid, (0, False))
            if a.request.gpus:
                taken[uuid] = (memory, True)
            else:
                taken[uuid] = (memory + a.request.gpu_memory_bytes, whole)
    if not taken:
        return state
    gpus = []
    for g in state.gpus:
        if g.uuid not in taken:
            gpus.append(g)
            continue
        memory, whole = taken[g.uuid]
        if whole:
            gpus.append(replace(g, milli_free=0, memory_free_bytes=0))
        else:
            gpus.append(replace(g, memory_free_bytes=max(0, g.memory_free_bytes - memory)))
    return replace(state, gpus=tuple(gpus))
