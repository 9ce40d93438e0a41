"""The node carries out the cluster's decision: the GPUs the scheduler extender chose for a pod.

The extender writes its choice on the pod (gpunode.io/gpu-assigned: GPU UUIDs,
comma-separated) before it binds the pod to this node. The kubelet's device-plugin
calls do not name the pod, so AssignmentBook keeps the pods that may be admitted
next: one list+watch of the pods bound to this node (fieldSelector
spec.nodeName=<node>), keeping those that carry an assignment, are Pending, are
not being deleted and are not yet marked carried out. As HAMi does, the pod being
admitted is, among those, the one with a container asking for exactly as many
devices of the resource as the kubelet asks for, first bound first. The kubelet
admits pods in the order its watch of the API server delivers them, which is the
order of the bindings' resourceVersions; the book orders its pods the same way:
by the resourceVersion of the pod as first seen bound here (the binding's, as the
watch delivers it), then by arrival. No clock is involved, so equal requests bound
within one second are still told apart. When no pod matches, the kubelet may have
seen the pod before this watch did: the book waits up to CATCH_UP_S for newer
events before it leaves the decision to the node, but only where pods on this
node carried assignments within the last EXTENDER_IN_USE_S, or for the first
allocation after the agent started while none has been seen yet (the first pod
bound to a fresh node: its assignment is the first the book could see); a
cluster without the extender waits that once and never again.

GetPreferredAllocation then chooses among the devices of the assigned GPUs only
(gpunode.node.allocation.preferred, `within`); Allocate checks the device IDs the
kubelet sends against the assignment. When the pod's device-requesting containers
are all allocated, the assignment is carried out: recorded at once in
state_dir/assignments.json (atomic rewrite), then on the pod as
gpunode.io/gpu-allocated (the GPUs it got), patched in the background; either
record keeps it from ever being used again, across agent restarts too.

No pod matching, or an assignment that cannot be carried out (a GPU unhealthy or
not on this node, its units taken), leaves the decision to the node as before:
one log line with the reason, and the counter gpunode_assignments_total{outcome}
counts followed, no_assignment and not_possible per allocated container. Nothing
here ever fails an allocation. Without API access the book is not built at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightkube.resources.core_v1 import Pod
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpunode.contract.names import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION, GPU_MILLI_ANNOTATION
from gpunode.errors import AllocationError, KubeError, KubeNotFound
from gpunode.infra.kube import DELETED, SYNC, KubeClient, WatchEvent
from gpunode.node.allocation.preferred import preferred_allocation
from gpunode.node.assignment_file import CarriedOut
from gpunode.node.state import Snapshot

log = logging.getLogger(__name__)

FOLLOWED, NO_ASSIGNMENT, NOT_POSSIBLE = "followed", "no_assignment", "not_possible"
OUTCOMES = (FOLLOWED, NO_ASSIGNMENT, NOT_POSSIBLE)
MAX_ASSIGNED_GPUS = 64  # an annotation naming more is not the extender's
MAX_UUID_CHARS = 128
MAX_RECORDS = 4096  # carried-out pods remembered (the pods of one node, many times over)
MAX_PROPOSALS = 256
SYNC_WAIT_S = 2.0  # how long a first allocation waits for the first list of pods
CATCH_UP_S = 1.5  # how long an allocation no pod matches waits for the watch to deliver newer events
EXTENDER_IN_USE_S = 3600.0  # ... when a pod on this node carried an assignment within this long
RETRY_INITIAL_S, RETRY_MAX_S = 1.0, 60.0
ANNOTATE_ATTEMPTS = 5


@dataclass
class PendingPod:
    """A pod bound here with an assignment not yet carried out."""

    uid: str
    key: str  # namespace/name
    gpus: tuple[str, ...]  # the assigned GPU (or MIG) UUIDs
    order: tuple[int, int]  # (resourceVersion as first seen bound here, arrival): first bound first
    remaining: list[tuple[str, int]]  # (resource, count) of its containers not yet allocated
    given: list[str] = field(default_factory=list)  # the GPUs its allocated containers got


def parse_assignment(text: str) -> tuple[str, ...] | None:
    """The UUIDs of an assignment annotation, or None when it is not one the extender writes."""
    gpus = tuple(dict.fromkeys(g.strip() for g in text.split(",") if g.strip()))
    if not gpus or len(gpus) > MAX_ASSIGNED_GPUS:
        return None
    if any(len(g) > MAX_UUID_CHARS or not g.isprintable() or " " in g for g in gpus):
        return None
    return gpus


def container_requests(pod: Pod, served: Collection[str]) -> list[tuple[str, int]]:
    """(resource, count) per container (init containers first) and resource of `served` it asks for."""
    spec = pod.spec
    out: list[tuple[str, int]] = []
    if spec is None:
        return out
    for c in [*(spec.initContainers or ()), *(spec.containers or ())]:
        res = c.resources
        asked = {**((res.requests or {}) if res else {}), **((res.limits or {}) if res else {})}
        for resource, quantity in sorted(asked.items()):
            text = str(quantity)
            if resource in served and text.isdigit() and 0 < int(text) <= 1024:
                out.append((resource, int(text)))
    return out


def resource_version(pod: Pod) -> int:
    """The pod's resourceVersion as a number (the API server's are etcd revisions); past all when it is not."""
    text = (pod.metadata.resourceVersion if pod.metadata else None) or ""
    return int(text) if text.isdigit() and len(text) < 20 else 1 << 63


class AssignmentBook:
    """The pods bound to this node whose assignment is to be carried out (see the module docstring)."""

    def __init__(
        self,
        *,
        node_name: str,
        state_dir: Path,
        client_factory: Callable[[], KubeClient],
        served: Callable[[], Collection[str]],
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self.node_name = node_name
        self._client_factory = client_factory
        self._served = served
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self.store = CarriedOut(state_dir)
        self.carried_out: OrderedDict[str, list[str]] = OrderedDict(self.store.load())
        self.pending: dict[str, PendingPod] = {}
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.synced = asyncio.Event()
        self.failed = False  # the watch could not be started or ended with an error
        self._waited = False  # an allocation waited SYNC_WAIT_S for the first list in vain
        self._proposals: OrderedDict[tuple[str, frozenset[str]], str] = OrderedDict()
        self._why_not: dict[str, str] = {}  # pod UID -> why its assignment could not be carried out
        self._bad: set[str] = set()  # UIDs whose unusable annotation was reported
        self._to_annotate: asyncio.Queue[PendingPod] = asyncio.Queue()
        self._arrivals = 0  # pods taken into the book so far: the tie-break of equal resourceVersions
        self._changed = asyncio.Event()  # set by every step of the watch, for allocations waiting on it
        self._assignment_seen_at: float | None = None  # monotonic time a pod here last carried one
        self._caught_up_once = False  # an allocation waited CATCH_UP_S before any assignment was seen
        # "namespace/name" -> its gpunode.io/gpu-milli text, for every pod here that has one and has not
        # ended (read by gpunode.node.allocation.shares); on_compute_ask is called when it changes.
        self.compute_asks: dict[str, str] = {}
        self.pod_uids: dict[str, str] = {}  # "namespace/name" -> UID of every pod here that has not ended
        self.on_compute_ask: Callable[[], None] | None = None

    # -- the pods, from the watch --------------------------------------------------------------

    def apply(self, event: WatchEvent[Pod]) -> None:
        """Take one step of the list+watch into the book."""
        self._changed.set()
        asks = dict(self.compute_asks)
        self._note_compute_ask(event)
        if asks != self.compute_asks and self.on_compute_ask is not None:
            self.on_compute_ask()
        if event.type == SYNC:
            before, self.pending = self.pending, {}
            present = {p.metadata.uid for p in event.items if p.metadata and p.metadata.uid}
            for gone in [u for u in self.carried_out if u not in present]:
                del self.carried_out[gone]  # gone from the node: nothing can allocate for it again
            for item in sorted(event.items, key=resource_version):  # a list comes in name order
                self._consider(item, before)
            self.synced.set()
            return
        pod = event.object
        uid = pod.metadata.uid if pod is not None and pod.metadata else None
        if pod is None or not uid:
            return
        if event.type == DELETED:
            self.pending.pop(uid, None)
            self.carried_out.pop(uid, None)
            return
        self._consider(pod, self.pending)

    def _note_compute_ask(self, event: WatchEvent[Pod]) -> None:
        pods = event.items if event.type == SYNC else [event.object] if event.object is not None else []
        if event.type == SYNC:
            self.compute_asks, self.pod_uids = {}, {}
        for pod in pods:
            meta = pod.metadata
            if meta is None or not meta.name:
                continue
            key = f"{meta.namespace or 'default'}/{meta.name}"
            text = (meta.annotations or {}).get(GPU_MILLI_ANNOTATION)
            phase = (pod.status.phase if pod.status else None) or "Pending"
            ended = event.type == DELETED or phase in ("Succeeded", "Failed")
            if ended or text is None:
                self.compute_asks.pop(key, None)
            else:
                self.compute_asks[key] = str(text)[:64]
            if ended or not meta.uid:
                self.pod_uids.pop(key, None)
            else:
                self.pod_uids[key] = meta.uid

    def _consider(self, pod: Pod, before: dict[str, PendingPod]) -> None:
        meta = pod.metadata
        if meta is None or not meta.uid:
            return
        uid, annotations = meta.uid, meta.annotations or {}
        key = f"{meta.namespace or 'default'}/{meta.name}"
        phase = (pod.status.phase if pod.status else None) or "Pending"
        text = annotations.get(ASSIGNMENT_ANNOTATION)
        if text:
            self._assignment_seen_at = time.monotonic()
        if (
            not text
            or uid in self.carried_out
            or ALLOCATED_ANNOTATION in annotations
            or phase != "Pending"
            or meta.deletionTimestamp is not None
        ):
            self.pending.pop(uid, None)
            return
        gpus = parse_assignment(text)
        if gpus is None:
            if uid not in self._bad:
                self._bad.add(uid)
                log.warning(
                    "assignments: pod %s: %s is not a list of GPU UUIDs; ignored", key, ASSIGNMENT_ANNOTATION
                )
            return
        known = before.get(uid)
        if known is not None and known.gpus == gpus:
            self.pending[uid] = known  # keep the containers already allocated
            return
        asks = container_requests(pod, self._served())
        if asks:
            # Seen before under another assignment: it keeps its place (its binding is the same).
            order = known.order if known is not None else (resource_version(pod), self._arrivals)
            self._arrivals += 1
            self.pending[uid] = PendingPod(uid, key, gpus, order, asks)

    # -- the device plugin's side --------------------------------------------------------------

    def _first_bound(self, resource: str, count: int) -> PendingPod | None:
        fits = [p for p in self.pending.values() if (resource, count) in p.remaining]
        return min(fits, key=lambda p: p.order, default=None)

    async def _match(self, resource: str, count: int) -> PendingPod | None:
        """The pod the kubelet is admitting for `count` devices of `resource`: first bound first.

        None matching yet: the kubelet's watch may be ahead of ours, so wait up to CATCH_UP_S for
        newer events (other calls go on meanwhile) before leaving the decision to the node.
        """
        if not self.synced.is_set() and not self.failed and not self._waited:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SYNC_WAIT_S):
                    await self.synced.wait()
        if not self.synced.is_set():
            self._waited = True  # waited once: an API server that does not answer delays no other pod
            return None
        pod = self._first_bound(resource, count)
        if pod is not None or self.failed:
            return pod
        if not self._extender_in_use():
            if self._assignment_seen_at is not None or self._caught_up_once:
                return pod
            self._caught_up_once = True  # the first pod on a fresh node: its watch event may be on its way
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_S
        while pod is None and self.synced.is_set() and (left := deadline - loop.time()) > 0:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()
            pod = self._first_bound(resource, count)
        log.debug(
            "assignments: %d x %s matched no pod at first; after waiting %.2f s for the watch: %s",
            count,
            resource,
            CATCH_UP_S - max(deadline - loop.time(), 0.0),
            pod.key if pod is not None else "still none",
        )
        return pod

    def _extender_in_use(self) -> bool:
        """Whether pods on this node carried assignments lately: only then is a pod the watch has not
        delivered yet worth waiting for; a cluster without the extender never waits."""
        seen = self._assignment_seen_at
        return seen is not None and time.monotonic() - seen < EXTENDER_IN_USE_S

    async def prefer(
        self,
        snapshot: Snapshot,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        *,
        replica_placement: str,
    ) -> list[str] | None:
        """The devices of the assigned GPUs to prefer, or None: the node decides (no pod, or not possible)."""
        pod = await self._match(resource, size)
        if pod is None:
            return None
        why = unusable(snapshot, pod.gpus)
        if why is None:
            try:
                ids = preferred_allocation(
                    snapshot,
                    resource,
                    available,
                    must_include,
                    size,
                    replica_placement=replica_placement,
                    within=pod.gpus,
                )
            except (AllocationError, ValueError) as exc:
                why = str(exc)
        if why is not None:
            self._why_not[pod.uid] = why
            return None
        self._proposals[(resource, frozenset(ids))] = pod.uid
        while len(self._proposals) > MAX_PROPOSALS:
            self._proposals.popitem(last=False)
        return ids

    async def allocated(self, snapshot: Snapshot, resource: str, device_ids: Sequence[str]) -> str:
        """Count one allocated container's outcome and mark its pod's progress; "namespace/name" or ""."""
        uid = self._proposals.pop((resource, frozenset(device_ids)), None)
        pod = self.pending.get(uid) if uid else None
        if pod is None or (resource, len(device_ids)) not in pod.remaining:
            pod = await self._match(resource, len(device_ids))
        if pod is None:
            self.outcomes[NO_ASSIGNMENT] += 1
            log.info(
                "assignments: no pod bound here with an assignment asks for %d x %s; the node decided (%s)",
                len(device_ids),
                resource,
                ",".join(device_ids)[:300],
            )
            return ""
        got = gpus_of(snapshot, device_ids)
        if on_assigned(snapshot, device_ids, pod.gpus):
            self.outcomes[FOLLOWED] += 1
            self._why_not.pop(pod.uid, None)
            log.info("assignments: pod %s got its assigned GPU(s) %s", pod.key, ",".join(got))
        else:
            self.outcomes[NOT_POSSIBLE] += 1
            why = self._why_not.pop(pod.uid, None) or f"the kubelet asked for devices on {','.join(got)}"
            log.warning(
                "assignments: pod %s: the assignment %s was not carried out (%s); the node decided: %s",
                pod.key,
                ",".join(pod.gpus),
                why,
                ",".join(got),
            )
        pod.remaining.remove((resource, len(device_ids)))
        pod.given += [g for g in got if g not in pod.given]
        if not pod.remaining:
            await self._done(pod)
        return pod.key

    async def _done(self, pod: PendingPod) -> None:
        self.pending.pop(pod.uid, None)
        self.carried_out[pod.uid] = list(pod.given)
        while len(self.carried_out) > MAX_RECORDS:
            self.carried_out.popitem(last=False)
        try:
            await asyncio.to_thread(self.store.save, dict(self.carried_out))
        except OSError as exc:
            log.error(
                "assignments: cannot write %s: %s (the pod annotation still records it)", self.store.path, exc
            )
        self._to_annotate.put_nowait(pod)

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch the pods bound to this node and annotate the carried-out ones, until cancelled."""
        delay = self.retry_initial_s
        client: KubeClient | None = None
        annotator: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    if client is None:
                        client = self._client_factory()
                        annotator = asyncio.create_task(self._annotate(client), name="annotate pods")
                    events = client.watch(Pod, field_selector=f"spec.nodeName={self.node_name}")
                    async with contextlib.aclosing(events):
                        async for event in events:
                            self.apply(event)
                            self.failed, delay = False, self.retry_initial_s
                except KubeError as exc:
                    self.failed = True
                    self.synced.clear()
                    self.pending.clear()
                    log.warning(
                        "assignments: cannot watch the pods of node %s, so the node decides alone (retry in "
                        "%.0f s): %s (hint: %s)",
                        self.node_name,
                        delay,
                        exc,
                        exc.hint,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.retry_max_s)
        finally:
            if annotator is not None:
                annotator.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await annotator
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    async def _annotate(self, client: KubeClient) -> None:
        while True:
            pod = await self._to_annotate.get()
            namespace, _, name = pod.key.partition("/")
            delay = self.retry_initial_s
            for attempt in range(1, ANNOTATE_ATTEMPTS + 1):
                try:
                    await client.patch_pod_annotations(
                        namespace, name, {ALLOCATED_ANNOTATION: ",".join(pod.given)}
                    )
                    break
                except KubeNotFound:
                    break
                except KubeError as exc:
                    if attempt == ANNOTATE_ATTEMPTS:
                        log.warning(
                            "assignments: cannot annotate pod %s (recorded locally only): %s", pod.key, exc
                        )
                        break
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.retry_max_s)

    # -- metrics -------------------------------------------------------------------------------

    def collector(self) -> Collector:
        """The counter gpunode_assignments_total{outcome}, for a Prometheus registry."""
        return _OutcomeCollector(self)


class _OutcomeCollector(Collector):
    def __init__(self, book: AssignmentBook) -> None:
        self._book = book

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "gpunode_assignments",
            "Allocated containers by what became of the scheduler extender's GPU assignment: followed, "
            "no_assignment (no pod with one matched) or not_possible (the node decided instead).",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            family.add_metric([outcome], self._book.outcomes[outcome])
        yield family


def gpus_of(snapshot: Snapshot, device_ids: Iterable[str]) -> list[str]:
    """The GPU (MIG: the MIG device's) UUIDs the device IDs are on, in order, each once."""
    out: list[str] = []
    for dev_id in device_ids:
        st = snapshot.status(dev_id)
        uuid = st.device.target_uuid if st is not None else dev_id.split("::")[0]
        if uuid not in out:
            out.append(uuid)
    return out


def on_assigned(snapshot: Snapshot, device_ids: Iterable[str], gpus: Collection[str]) -> bool:
    """Whether every device is on the assigned GPUs: its GPU, or its MIG device, is one of them."""
    for dev_id in device_ids:
        st = snapshot.status(dev_id)
        if st is None:
            if dev_id.split("::")[0] not in gpus:
                return False
        elif st.device.gpu_uuid not in gpus and st.device.target_uuid not in gpus:
            return False
    return True


def unusable(snapshot: Snapshot, gpus: Sequence[str]) -> str | None:
    """Why the assigned GPUs cannot be used (one of them unknown here or unhealthy), or None."""
    inventory = snapshot.inventory
    for uuid in gpus:
        parents = {d.gpu_uuid for d in inventory.devices if d.mig_uuid == uuid}
        if inventory.gpu(uuid) is None and not parents:
            return f"GPU {uuid} is not on this node"
        for u in (uuid, *sorted(parents)):
            if u in snapshot.unhealthy:
                return f"GPU {u} is unhealthy ({snapshot.unhealthy[u]})"
    return None
