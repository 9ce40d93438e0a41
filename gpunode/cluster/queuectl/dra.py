"""GPUs served through DRA in the queue controller: what governed pods' ResourceClaims hold and ask.

A governed pod (a queue by label or namespace, as jobs.queued_pod reads it) that names ResourceClaims
(`spec.resourceClaims`: a claim by name, or one made from a template, found through
`status.resourceClaimStatuses`) is charged, in its leaf queue, what those claims of gpunode's driver
hold: read from the claim's `status.allocation` (gpunode.contract.draclaims.claim_uses, the parser the
extender's ClaimView uses) once allocated, else from its requests on gpunode's DeviceClasses:

- a whole GPU (the whole device, a time-sliced replica, a MIG placement without a memory figure): one
  GPU (1000 milli) and the GPU's memory;
- a share (`<gpu>-shared`, or anything with a consumed memory): that memory, and the same fraction of
  the GPU in milli-GPU, rounded up;
- while not allocated: `count` of the class (a share: `capacity.requests.memory` each) on a nominal
  GPU (the mean memory of the cluster's GPUs). `allocationMode: All`, a count beyond the API's 32
  results, a share naming no memory, or a request list that is not readable is a problem: the pod is
  not admitted and says why.

Claims are always in the pod's namespace (a pod names a claim, never its namespace), so a name cannot
charge another namespace's claim. A claim several pods share is charged once: to its reserving pod
(`status.reservedFor`) when it has one, else to the earliest pod naming it. Everything read is bounded
(results and requests by the API's 32, claims per pod by MAX_CLAIMS); nothing a claim says can raise.
Pure functions; no I/O. The controller's watch keeps one DraClaim per claim (read_claim), not the
claim itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gpunode.cluster.extender.queued import parse_time, queue_of
from gpunode.cluster.queuectl.gates import gated, gates_of
from gpunode.cluster.queuectl.writes import Actions, Annotate, PodRef, Release
from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.model import GPU, GPU_MEMORY, Amounts, add, model_key
from gpunode.cluster.queueing.quotas import describe
from gpunode.contract.dra import CLASS_MIG, CLASS_SHARED, CLASS_TIME_SLICED, CLASS_WHOLE
from gpunode.contract.draclaims import (
    MAX_MEMORY_BYTES,
    MAX_RESULTS,
    DeviceUse,
    claim_uses,
    gpu_of_device,
    shared_device_name,
)
from gpunode.contract.names import ADMISSION_GATE, GIB, MILLI_PER_GPU, QUEUE_REASON_ANNOTATION, Sharing
from gpunode.contract.quantity import ceil, parse_quantity
from gpunode.errors import QuantityError
from gpunode.placement.model import GpuState, NodeState

MAX_CLAIMS = 128  # per pod; far above any real pod
NOMINAL_GPU_MEMORY = 80 * GIB  # a pending share's GPU when the cluster publishes none
CLASSES = (CLASS_WHOLE, CLASS_SHARED, CLASS_MIG, CLASS_TIME_SLICED)


@dataclass(frozen=True)
class Ask:
    """One request of a pending claim on gpunode's DeviceClasses: `count` devices of `kind`."""

    kind: str  # one of CLASSES
    count: int
    memory_bytes: int | None  # capacity.requests.memory of each (a share)


@dataclass(frozen=True)
class DraClaim:
    """What the controller keeps of one ResourceClaim (see the module docstring)."""

    key: str  # namespace/name
    uses: tuple[DeviceUse, ...]  # allocated devices of our driver
    asks: tuple[Ask, ...]  # its requests on our classes (read while not allocated)
    allocated: bool
    reserved: frozenset[str]  # UIDs of the pods it is reserved for
    problem: str = ""  # why its demand cannot be counted ("" when it can)
    said: tuple[str, ...] = ()  # malformed allocation results skipped (claim_uses)


def _key(claim: Mapping[str, Any]) -> str:
    meta = claim.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    ns, name = meta.get("namespace"), meta.get("name")
    return f"{ns if isinstance(ns, str) else '?'}/{name if isinstance(name, str) else '?'}"[:320]


def _ask(req: Mapping[str, Any], where: str) -> tuple[Ask | None, str]:
    """One exact request (or one firstAvailable alternative): (Ask, "") of ours, (None, "") not ours, or
    (None, problem)."""
    cls = req.get("deviceClassName")
    if cls not in CLASSES:
        return None, ""
    mode = req.get("allocationMode", "ExactCount")
    if mode == "All":
        return None, f"{where} asks for all devices of {cls}: its GPUs cannot be counted against a quota"
    if mode not in ("ExactCount", None):
        return None, f"{where}: allocationMode {str(mode)[:40]!r} is not ExactCount"
    count = req.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_RESULTS:
        return None, f"{where}: count {str(count)[:40]} is not 1..{MAX_RESULTS}"
    memory: int | None = None
    capacity = req.get("capacity")
    requests = capacity.get("requests") if isinstance(capacity, Mapping) else None
    if isinstance(requests, Mapping) and "memory" in requests:
        try:
            memory = ceil(parse_quantity(requests["memory"], where=f"{where} memory"))
        except QuantityError as exc:
            return None, str(exc)
        if not 0 < memory <= MAX_MEMORY_BYTES:
            return None, f"{where}: memory {memory} is not 1..{MAX_MEMORY_BYTES} bytes"
    if cls == CLASS_SHARED and memory is None:
        return None, f"{where} asks for a share of a GPU without capacity.requests.memory"
    return Ask(str(cls), count, memory), ""


def _asks(claim: Mapping[str, Any], ref: str) -> tuple[tuple[Ask, ...], str]:
    spec = claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    if requests is None:
        return (), ""
    if not isinstance(requests, list) or len(requests) > MAX_RESULTS:
        return (), f"claim {ref}: spec.devices.requests is not a list of at most {MAX_RESULTS}"
    out: list[Ask] = []
    for i, req in enumerate(requests):
        if not isinstance(req, Mapping):
            return (), f"claim {ref}: request {i} is not an object"
        where = f"claim {ref} request {i}"
        if isinstance(req.get("exactly"), Mapping):
            ask, problem = _ask(req["exactly"], where)
        elif isinstance(req.get("firstAvailable"), list):  # the largest alternative of ours: never less
            ask, problem = None, ""
            for j, alt in enumerate(req["firstAvailable"][:8]):
                a, p = _ask(alt, f"{where} alternative {j}") if isinstance(alt, Mapping) else (None, "")
                problem = problem or p
                if a is not None and (ask is None or _size(a) > _size(ask)):
                    ask = a
        else:
            ask, problem = _ask(req, where)  # the v1beta1 form: the fields on the request itself
        if problem:
            return (), problem
        if ask is not None:
            out.append(ask)
    return tuple(out), ""


def _size(a: Ask) -> int:
    return a.count * (a.memory_bytes if a.kind == CLASS_SHARED and a.memory_bytes else MAX_MEMORY_BYTES)


def read_claim(claim: object, driver: str) -> DraClaim | None:
    """The claim as the controller keeps it (empty when it neither holds nor asks anything of ours: a pod
    waiting for it knows it exists); None when it is not an object."""
    if not isinstance(claim, Mapping):
        return None
    ref = _key(claim)
    said: list[str] = []
    uses = claim_uses(claim, driver, said)
    status = claim.get("status")
    status = status if isinstance(status, Mapping) else {}
    allocated = isinstance(status.get("allocation"), Mapping)
    asks, problem = _asks(claim, ref)
    reserved = status.get("reservedFor")
    uids = frozenset(
        r["uid"][:64]
        for r in (reserved[:256] if isinstance(reserved, list) else ())
        if isinstance(r, Mapping) and isinstance(r.get("uid"), str)
    )
    return DraClaim(ref, tuple(uses), asks, allocated, uids, problem, tuple(said[:4]))


@dataclass(frozen=True)
class DraPod:
    """A governed pod that names ResourceClaims."""

    key: str  # namespace/name
    uid: str
    queue: str
    claims: tuple[str, ...]  # namespace/name of its claims (resolved ones)
    unresolved: tuple[str, ...]  # its claims from templates not made yet (pod claim names)
    gated: bool
    created: float
    device_plugin: bool  # it also asks GPUs by device-plugin resources (queued as a pod too)
    reason: str = ""  # its gpunode.io/queue-reason annotation now
    problem: str = ""  # why it cannot be queued (its queue is no leaf)

    @property
    def ref(self) -> PodRef:
        """The pod to write to."""
        ns, name = self.key.split("/", 1)
        return PodRef(ns, name, self.uid)


def dra_pod(pod: Mapping[str, Any], config: QueueConfig, *, device_plugin: bool) -> DraPod | None:
    """The pod's DRA side, or None: not governed (no leaf queue), finished, being deleted, or no claims."""
    queue = queue_of(pod, config.namespaces)
    if queue is None:
        return None
    spec_q = config.queues.get(queue)
    problem = (
        ""
        if spec_q is not None and spec_q.leaf
        else f"queue {queue!r} is not a leaf queue of the queue configuration"
    )
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") is not None or status.get("phase") in ("Succeeded", "Failed"):
        return None
    claims = spec.get("resourceClaims")
    if not isinstance(claims, list) or not claims:
        return None
    ns = str(meta.get("namespace") or "default")
    made = {
        s.get("name"): s.get("resourceClaimName")
        for s in (status.get("resourceClaimStatuses") or ())[:MAX_CLAIMS]
        if isinstance(s, Mapping)
    }
    names: list[str] = []
    unresolved: list[str] = []
    for c in claims[:MAX_CLAIMS]:
        if not isinstance(c, Mapping):
            continue
        name = c.get("resourceClaimName")
        if not isinstance(name, str) and c.get("resourceClaimTemplateName") is not None:
            name = made.get(c.get("name"))
            if not isinstance(name, str):
                unresolved.append(str(c.get("name"))[:63])
                continue
        if isinstance(name, str) and name:
            names.append(f"{ns}/{name[:253]}")  # the pod's own namespace: a claim is never elsewhere
    return DraPod(
        key=f"{ns}/{meta.get('name')}",
        uid=str(meta.get("uid") or ""),
        queue=queue,
        claims=tuple(dict.fromkeys(names)),
        unresolved=tuple(unresolved),
        gated=gated(pod),
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        device_plugin=device_plugin,
        reason=str((meta.get("annotations") or {}).get(QUEUE_REASON_ANNOTATION) or ""),
        problem=problem,
    )


def _add(out: Amounts, milli: int, memory: int, model: str | None = None) -> None:
    out[GPU] = out.get(GPU, 0) + milli
    out[GPU_MEMORY] = out.get(GPU_MEMORY, 0) + memory
    if model:
        out[model_key(model)] = out.get(model_key(model), 0) + milli


def _share(memory: int, total: int) -> int:
    return min(MILLI_PER_GPU, -(-memory * MILLI_PER_GPU // max(total, 1)))


class GpuIndex:
    """The cluster's GPUs served through DRA, by node, for a claim's devices; and the nominal GPU memory."""

    def __init__(self, nodes: Iterable[NodeState]) -> None:
        self.by_node: dict[str, tuple[GpuState, ...]] = {}
        sizes: list[int] = []
        for n in nodes:
            self.by_node[n.name] = tuple(g for g in n.gpus if g.sharing == Sharing.DRA)
            sizes.extend(g.memory_total_bytes for g in n.gpus if g.memory_total_bytes > 0)
        self.nominal = sum(sizes) // len(sizes) if sizes else NOMINAL_GPU_MEMORY

    def gpu(self, node: str, device: str) -> GpuState | None:
        """The DRA GPU of this node (pool) the device belongs to, or None."""
        gpus = self.by_node.get(node, ())
        uuid = gpu_of_device(device, [g.uuid for g in gpus])
        return next((g for g in gpus if g.uuid == uuid), None)


def claim_amounts(claim: DraClaim, gpus: GpuIndex) -> Amounts:
    """What the claim charges: its allocated devices once allocated, else its requests (see the module
    docstring). A claim with a problem charges nothing here (its pod is not admitted for it)."""
    out: Amounts = {}
    if claim.allocated:
        for use in claim.uses:
            g = gpus.gpu(use.pool, use.device)
            total = g.memory_total_bytes if g is not None and g.memory_total_bytes > 0 else gpus.nominal
            model = g.model if g is not None else None
            shared = g is not None and use.device == shared_device_name(g.uuid)
            if shared or use.memory_bytes is not None:
                memory = min(use.memory_bytes or 0, total)
                _add(out, _share(memory, total), memory, model)
            else:  # the whole GPU, a time-sliced replica, a MIG placement without a memory figure
                _add(out, MILLI_PER_GPU, total, model)
        return out
    for a in claim.asks:
        if a.kind == CLASS_SHARED or (a.kind == CLASS_MIG and a.memory_bytes):
            memory = min(a.memory_bytes or 0, gpus.nominal)
            _add(out, a.count * _share(memory, gpus.nominal), a.count * memory)
        else:
            _add(out, a.count * MILLI_PER_GPU, a.count * gpus.nominal)
    return out


@dataclass
class DraUsage:
    """Governed pods' DRA claims at one reconcile: what each leaf holds, and the gated pods waiting."""

    held: dict[str, Amounts] = field(default_factory=dict)  # leaf -> amounts of its ungated pods
    waiting: list[tuple[DraPod, Amounts, str]] = field(default_factory=list)  # (pod, demand, problem)
    charged: dict[str, str] = field(default_factory=dict)  # claim -> the pod it is charged to


def dra_usage(pods: Iterable[DraPod], claims: Mapping[str, DraClaim], gpus: GpuIndex) -> DraUsage:
    """Charge each claim once (its reserving pod, else the earliest pod naming it); gated DRA-only pods
    wait in order of creation with their demand (claims already charged to a running pod add nothing)."""
    ordered = sorted(pods, key=lambda p: (p.created, p.key))
    namers: dict[str, list[DraPod]] = {}
    for p in ordered:
        for c in p.claims:
            namers.setdefault(c, []).append(p)
    out = DraUsage()
    for c, ps in namers.items():
        claim = claims.get(c)
        if claim is None:
            continue
        reserving = [p for p in ps if p.uid in claim.reserved]
        out.charged[c] = (reserving or ps)[0].key
    for p in ordered:
        mine = [claims[c] for c in p.claims if c in claims and out.charged.get(c) == p.key]
        amounts: Amounts = {}
        for claim in mine:
            for k, v in claim_amounts(claim, gpus).items():
                amounts[k] = amounts.get(k, 0) + v
        if not p.gated and not p.problem:
            acc = out.held.setdefault(p.queue, {})
            for k, v in amounts.items():
                acc[k] = acc.get(k, 0) + v
            continue
        if p.device_plugin or not p.gated:
            continue  # admitted with its device-plugin GPUs by the engine; its claims count once it runs
        problem = p.problem or next(
            (claims[c].problem for c in p.claims if c in claims and claims[c].problem), ""
        )
        missing = [c for c in p.claims if c not in claims]
        if not problem and (p.unresolved or missing):
            first = (p.unresolved or tuple(m.split("/", 1)[1] for m in missing))[0]
            problem = f"waiting for its ResourceClaim {first!r} to exist"
        out.waiting.append((p, amounts, problem))
    return out


def dra_capacity(nodes: Iterable[NodeState]) -> Amounts:
    """The healthy GPUs served through DRA: one GPU and its memory each (and per model)."""
    out: Amounts = {}
    for n in nodes:
        for g in n.gpus:
            if g.sharing == Sharing.DRA and g.healthy:
                _add(out, MILLI_PER_GPU, g.memory_total_bytes, g.model)
    return out


def gate_removal(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The spec merge patch that removes the admission gate only (kube-scheduler's allocator chooses the
    node and the devices of a DRA pod): other gates stay."""
    rest = [dict(g) for g in gates_of(pod) if g.get("name") != ADMISSION_GATE]
    return {"schedulingGates": rest or None}


def step(
    sched: Scheduler | None,
    nodes: Iterable[NodeState],
    pods: Iterable[DraPod],
    claims: Mapping[str, DraClaim],
    raw: Mapping[str, Mapping[str, Any]],
    released: set[str],
    now: float,
    out: Actions,
) -> DraUsage:
    """One reconcile's DRA part: charge each leaf what its governed pods' claims hold (Scheduler.charge_outside:
    quotas, fair share and usage memory), then admit the gated DRA pods, in order of creation, whose demand
    the quotas allow (the gate removed, nothing pinned: `released` gets their UIDs, and they count as held
    from then on); the others get their reason in gpunode.io/queue-reason. `raw`: the pods' JSON by key."""
    pods = tuple(pods)
    if sched is None or (not pods and sched.outside_capacity is not None and not sched.outside):
        return DraUsage()  # nothing to count (the usual case without DRA: no walk over the nodes)
    nodes = tuple(nodes)
    gpus = GpuIndex(nodes) if pods else GpuIndex(())
    usage = dra_usage((replace(p, gated=False) if p.uid in released else p for p in pods), claims, gpus)
    held = {q: dict(a) for q, a in usage.held.items()}
    # the DRA GPUs' capacity once per Scheduler: a change of the nodes rebuilds it (core._sync)
    sched.charge_outside(held, now, dra_capacity(nodes) if sched.outside_capacity is None else None)
    for p, demand, problem in usage.waiting:
        reason = problem
        if not reason:
            over = sched.book.over_limit(p.queue, demand)
            if over is None:
                held[p.queue] = add(held.get(p.queue, {}), demand)
                sched.charge_outside(held, now)
                released.add(p.uid)
                gpu = demand.get(GPU, 0)
                out.annotate.append(
                    Annotate(
                        p.ref,
                        {QUEUE_REASON_ANNOTATION: None} if p.reason else {},
                        ("QueueAdmitted", f"admitted in {p.queue}: {describe(GPU, gpu)} through DRA"),
                        job=p.key,
                    )
                )
                pod = raw.get(p.key)
                if pod is not None and gated(pod):
                    out.release.append(Release(p.ref, "", gate_removal(pod), job=p.key))
                out.admitted_jobs.append(p.key)
                continue
            queue, resource = over
            limit = sched.config.limit(queue) or {}
            reason = (
                f"queued in {p.queue}: {queue} is over its quota: it holds "
                f"{describe(resource, sched.book.allocated[queue].get(resource, 0))} of at most "
                f"{describe(resource, limit.get(resource, 0))}; its ResourceClaims ask "
                f"{describe(resource, demand.get(resource, 0))}"
            )
        if reason != p.reason:
            out.annotate.append(Annotate(p.ref, {QUEUE_REASON_ANNOTATION: reason}, ("Queued", reason)))
    usage.held = held
    return usage
