"""The kube-scheduler extender: filter, prioritize and bind over HTTP, deciding through placement.

kube-scheduler (extender protocol v1, k8s.io/kube-scheduler/extender/v1) POSTs
ExtenderArgs {Pod, Nodes | NodeNames} to /filter and /prioritize, and
ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node} to /bind when the
bind verb is configured. Answers use the protocol's field names:
ExtenderFilterResult {Nodes, NodeNames, FailedNodes, FailedAndUnresolvableNodes,
Error}, HostPriorityList [{Host, Score}] with scores 0..10, and
ExtenderBindingResult {Error}. With the preempt verb configured, kube-scheduler POSTs
ExtenderPreemptionArgs to /preempt before its own preemption evicts anyone (preempt.py: never for a
pod a queue governs). Keys are matched case-insensitively, as Go's JSON decoder does.

Each node's GPU state comes from its gpunode.io/gpu-state annotation (see
nodestate.py; an annotation older than the node cache's max age fails its node);
reservations made at bind (and, provisionally, for the only node filter passes or
the best node at prioritize, for a pod the API server has pending with the body's UID
and request: PendingPods, through `pod_reader`) are applied on top until the annotation
lists the pod (see reservations.py for when each kind ends, and the bound per namespace). Bind decides and reserves in one step
under the node's lock (decide.py). Bad input never crashes the server and never gets a 500: malformed
JSON or a wrong shape is a 400 with a JSON message, a node with a missing or
broken annotation goes to FailedNodes with the reason, a pod with an impossible
request fails every node in FailedNodes and FailedAndUnresolvableNodes with the reason.

The HTTP server (server.py, on gpunode.infra.http) calls these methods in worker
threads; serve_extender() is the coroutine the CLI runs. Binding talks to the Kubernetes API through
kubeapi.py's small client, and only after the checks of binding.py: the pod, read from the API
server, is pending, names a scheduler this extender serves, and filter passed that node for it.
A pod with an unreadable or implausible quantity fails its own filter and is never learned from.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from gpunode.cluster.extender.args import ExtenderArgs, filter_result, parse_args
from gpunode.cluster.extender.binding import (
    DEFAULT_SCHEDULER,
    Approved,
    FilterLog,
    check_bind,
    parse_bind_args,
    refuse,
)
from gpunode.cluster.extender.decide import NodeLocks, decide_and_reserve
from gpunode.cluster.extender.drasteer import (
    Assumed,
    DraClaim,
    claim_request,
    dra_state,
    pod_claim_refs,
    with_assumed,
)
from gpunode.cluster.extender.nodes import NodeCache, NodeView, OnDemandRefresh
from gpunode.cluster.extender.pods import pod_key, request_from_pod
from gpunode.cluster.extender.preempt import answer_preemption
from gpunode.cluster.extender.promfeed import FeedMetrics, LoadFeed, blend
from gpunode.cluster.extender.queued import (
    HOLD_ERROR,
    HOLD_MODES,
    Hold,
    hold_error,
    hold_filter,
    hold_filter_again,
    hold_scores,
    plan_error,
    queue_hold,
)
from gpunode.cluster.extender.reservations import (
    DEFAULT_BOUND_TTL_S,
    DEFAULT_PROVISIONAL_PER_NAMESPACE,
    PendingPods,
    PodRead,
    Reservation,
    Reservations,
    apply_reservations,
    live_on,
    pending_reason,
    reserved_state,
)
from gpunode.cluster.extender.table import NodeTable
from gpunode.cluster.extender.workload import WorkloadTracker
from gpunode.cluster.queuemark import MarkKey
from gpunode.contract.names import GIB
from gpunode.errors import BadRequest, InvalidRequest, KubeError, PlacementError
from gpunode.placement import (
    NEEDS_WORKLOAD,
    NodeState,
    Request,
    TargetWorkload,
    check_policy,
    score_node,
    unfit_reason,
)

log = logging.getLogger(__name__)
MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority
_CACHE_LIMIT = 500_000  # cached verdicts before the caches are dropped and rebuilt
_UNSET: Any = object()
MAX_WEIGHT = 100.0  # of the energy and load terms, against the policy's 1


@dataclass(frozen=True)
class _Context:
    uid: str
    reserved: frozenset[str]
    workload: TargetWorkload | None
    policy: str
    version: int


@dataclass(frozen=True)
class _Verdict:
    reason: str | None  # None: fits
    scored: tuple[float, tuple[str, ...]] | None  # (policy score, GPUs) when asked and it fits


class Binder(Protocol):
    """Reads a pod, binds it to a node (and records the GPUs chosen); raises KubeError on failure."""

    def read_pod(self, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod as v1 JSON, None when it does not exist; raises KubeError when it cannot be read."""
        ...

    def bind(self, *, namespace: str, name: str, uid: str, node: str, gpu_uuids: tuple[str, ...]) -> None:
        """Bind pod namespace/name (uid) to node, recording gpu_uuids; raises KubeError on failure."""
        ...


@dataclass(frozen=True)
class ExtenderConfig:
    """Extender settings; raises InvalidRequest for an unknown policy or a non-positive unit or TTL.

    memory_unit_bytes is the size of one unit of a pod's memory request; reservation_ttl_s is how
    long a provisional reservation lasts; bound_reservation_max_age_s the most seconds a bound pod's
    reservation stays while the node's annotation does not list the pod (and the pod exists);
    provisional_reservations makes filter (when one node passes) and prioritize reserve, for pods the API
    server has pending (at most max_provisional_per_namespace per namespace); bind binds
    only pods whose spec.schedulerName is in scheduler_names. energy_weight and load_weight (0..100)
    weigh the energy and load terms against the policy's score (weight 1) at prioritize, when the
    Extender has a load feed. queue_hold (queued.HOLD_MODES) is how filter holds a queued pod.
    """

    policy: str = "gpunode"
    memory_unit_bytes: int = GIB
    reservation_ttl_s: float = 60.0
    provisional_reservations: bool = True
    scheduler_names: frozenset[str] = frozenset({DEFAULT_SCHEDULER})
    bound_reservation_max_age_s: float = DEFAULT_BOUND_TTL_S
    energy_weight: float = 0.5
    load_weight: float = 0.2
    queue_hold: str = HOLD_ERROR
    max_provisional_per_namespace: int = DEFAULT_PROVISIONAL_PER_NAMESPACE

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if self.max_provisional_per_namespace < 1:
            raise InvalidRequest(
                f"provisional reservations per namespace must be 1 or more, got {self.max_provisional_per_namespace}"
            )
        if self.queue_hold not in HOLD_MODES:
            raise InvalidRequest(
                f"queue hold must be one of {', '.join(HOLD_MODES)}, got {self.queue_hold!r}"
            )
        for weight in (self.energy_weight, self.load_weight):
            if not (math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
                raise InvalidRequest(f"energy and load weights must be in 0..{MAX_WEIGHT}, got {weight}")
        if (
            self.memory_unit_bytes <= 0
            or self.reservation_ttl_s <= 0
            or self.bound_reservation_max_age_s <= 0
        ):
            raise InvalidRequest(
                "memory unit, reservation TTL and bound reservation max age must be positive"
            )


class Extender:
    """The protocol logic, without HTTP: dicts in, dicts out; thread safe."""

    def __init__(
        self,
        *,
        config: ExtenderConfig | None = None,
        nodes: NodeCache | None = None,
        reservations: Reservations | None = None,
        workload: WorkloadTracker | None = None,
        binder: Binder | None = None,
        node_lister: Callable[[], Iterable[object]] | None = None,
        load_feed: LoadFeed | None = None,
        queue_namespaces: Callable[[], Mapping[str, str]] = dict,
        mark_key: MarkKey | None = None,
        pod_reader: PodRead | None = None,
    ) -> None:
        """`node_lister` (names-only mode): lists every Node when a request names nodes not yet cached;
        `load_feed`: figures for the energy and load terms of prioritize (none: the policy alone);
        `queue_namespaces`: the namespaces whose GPU pods the queue controller holds (queued.py);
        `mark_key`: the key admission marks must be signed with (None: unsigned marks count, by UID);
        `pod_reader`: reads a pod (namespace, name) from the API server, to make provisional reservations
        only for pods that exist and wait (default: the binder's read_pod; neither: none are made)."""
        self.config = config or ExtenderConfig()
        self.load_feed = load_feed
        self.queue_namespaces = queue_namespaces
        self.mark_key = mark_key
        self.metrics = load_feed.metrics if load_feed is not None else FeedMetrics()
        # `is None`, not `or`: an empty cache or reservation book has len() 0 and is falsy.
        self.nodes = NodeCache() if nodes is None else nodes
        self.nodes.register_metrics(self.metrics.registry)
        self.reservations = (
            Reservations(
                ttl_s=self.config.reservation_ttl_s,
                bound_ttl_s=self.config.bound_reservation_max_age_s,
                max_provisional_per_namespace=self.config.max_provisional_per_namespace,
            )
            if reservations is None
            else reservations
        )
        if pod_reader is None and binder is not None:
            read_pod = binder.read_pod
            pod_reader = lambda namespace, name: read_pod(namespace=namespace, name=name)  # noqa: E731
        self.pending = PendingPods(pod_reader) if pod_reader is not None else None
        self.workload = WorkloadTracker() if workload is None else workload
        self.table = NodeTable()
        self.binder = binder
        self.on_demand = None if node_lister is None else OnDemandRefresh(self.nodes, node_lister)
        self.filtered = FilterLog()
        self._fits: dict[tuple[object, ...], object] = {}
        self._supplied: tuple[tuple[object, ...], TargetWorkload, int] | None = None
        self._scores: dict[tuple[object, ...], object] = {}
        self._lock = threading.Lock()  # the caches above; never held while deciding
        self._deciding = NodeLocks()  # bind's decide-and-reserve, per node
        self.assumed = Assumed()  # prioritize-claims' answers whose claims are not allocated yet

    # ----- shared steps ---------------------------------------------------------------------------

    def refresh_nodes(self, nodes: Iterable[object]) -> int:
        """Feed Node objects into the cache used when kube-scheduler sends only node names.

        Reservations that the fresh annotations list end here too, not only at the next request naming
        their node: a pod deleted before such a request would otherwise keep its GPUs reserved until the
        next reservation check (kubeapi.check_reservations), and a queued pod admitted onto them meanwhile
        would fail filter and wait for kube-scheduler's next retry."""
        count = self.nodes.update(nodes)
        for view in self.nodes.get_many(sorted(self.reservations.nodes())):
            live_on(view, self.reservations)
        return count

    def _views(self, args: ExtenderArgs) -> list[NodeView]:
        if args.node_objects is not None:
            return [self.nodes.view(n) for n in args.node_objects]
        assert args.node_names is not None
        if self.on_demand is not None:
            return self.on_demand.get_many(args.node_names)
        return self.nodes.get_many(args.node_names)

    def _request(self, pod: Mapping[str, Any]) -> tuple[str, str, Request | None]:
        try:
            uid, key = pod_key(pod)
        except InvalidRequest as exc:
            raise BadRequest(str(exc)) from exc
        return uid, key, request_from_pod(pod, memory_unit_bytes=self.config.memory_unit_bytes)

    def _hold(self, pod: Mapping[str, Any]) -> Hold | None:
        """The queue controller's hold on a GPU pod (None: no queue governs it)."""
        return queue_hold(pod, self.queue_namespaces(), self.mark_key)

    def _state(self, view: NodeView, uid: str) -> NodeState | None:
        return apply_reservations(view, self.reservations, skip_pod=uid)

    def _context(self, uid: str) -> _Context:
        """What every node's evaluation in one request shares: reserved nodes, workload, policy."""
        workload = self.workload.workload() if self.config.policy in NEEDS_WORKLOAD else None
        policy = self.config.policy
        if policy in NEEDS_WORKLOAD and workload is None:
            policy = "bestfit"  # nothing to measure fragmentation against yet
        version = self.workload.version
        if workload is not None:
            workload, version = self._with_supply(workload, version)
        return _Context(uid, self.reservations.nodes(), workload, policy, version)

    def _with_supply(self, workload: TargetWorkload, version: int) -> tuple[TargetWorkload, int]:
        """The workload with model and node pressure for the nodes the extender knows (recomputed as they change)."""
        supply = self.nodes.gpu_supply()
        key = (version, tuple(sorted(supply.items())), self.nodes.capacity_version)
        with self._lock:
            if self._supplied is None or self._supplied[0] != key:
                serial = self._supplied[2] + 1 if self._supplied is not None else 0
                # the node list is copied only here, when something changed, not on every request
                _, capacities = self.nodes.node_capacities()
                supplied = workload.with_supply(supply, nodes=capacities, demand=self.workload.demand())
                self._supplied = (key, supplied, serial)
            return self._supplied[1], self._supplied[2]

    def _evaluate(self, view: NodeView, request: Request, ctx: _Context, *, score: bool) -> _Verdict:
        """Fit (and the policy's score) of one node, cached until its annotation or reservations change."""
        if view.state is None:
            return _Verdict(view.reason or "no usable GPU state", None)
        state = view.state
        held: tuple[str, ...] = ()
        if view.name in ctx.reserved:
            live = [r for r in live_on(view, self.reservations) if r.pod_uid != ctx.uid]
            if live:
                held = tuple(sorted(r.pod_uid for r in live))
                state = reserved_state(state, live)
        key = (view.name, view.fingerprint, held, request)
        with self._lock:
            reason = self._fits.get(key, _UNSET)
        if reason is _UNSET:
            try:
                reason = unfit_reason(state, request)
            except Exception as exc:  # one node's state never fails the request (nodes.py)
                log.warning("node %s: its GPU state could not be evaluated: %r", view.name, exc)
                return _Verdict(f"its GPU state could not be evaluated: {type(exc).__name__}: {exc}", None)
            with self._lock:
                if len(self._fits) > _CACHE_LIMIT:
                    self._fits.clear()
                self._fits[key] = reason
        if reason is not None or not score:
            return _Verdict(reason, None)  # type: ignore[arg-type]
        score_key = (*key, ctx.policy, ctx.version)
        with self._lock:
            scored = self._scores.get(score_key, _UNSET)
        if scored is _UNSET:
            try:
                choice = score_node(state, request, policy=ctx.policy, workload=ctx.workload)
            except Exception as exc:  # as above: this node scores 0
                log.warning("node %s: its GPU state could not be scored: %r", view.name, exc)
                return _Verdict(None, None)
            scored = None if choice is None else (choice.score, choice.gpu_uuids)
            with self._lock:
                if len(self._scores) > _CACHE_LIMIT:
                    self._scores.clear()
                self._scores[score_key] = scored
        return _Verdict(None, scored)  # type: ignore[arg-type]

    # ----- filter ---------------------------------------------------------------------------------

    def filter(self, body: object) -> dict[str, Any]:
        """Answer /filter: an ExtenderFilterResult dict for ExtenderArgs `body`.

        Nodes the pod does not fit go to FailedNodes with the reason; an invalid GPU request fails every node
        in both maps (kube-scheduler 1.20 shows only FailedNodes in the pod's events). A pod without a GPU request passes every node. A queued pod is held until
        admitted (config.queue_hold error: Error with the queue's reason, so kube-scheduler does not preempt
        for it; unschedulable: every node failed, the reason in both maps), then passes only its admission's
        node (queued.py); when that node does not pass, error answers Error with why (no preemption for it
        either: the controller re-plans), unschedulable fails the nodes. Raises BadRequest when `body` is not
        valid ExtenderArgs.
        """
        args = parse_args(body)
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        views = self._views(args)
        try:
            uid, key, request = self._request(args.pod)
        except PlacementError as exc:
            self.filtered.forget(pod_key(args.pod)[0])
            reason = f"invalid GPU request: {exc}"
            unresolvable = {v.name: reason for v in views if v.name}
            return filter_result(args, [], dict(unresolvable), unresolvable)
        if request is None:
            passing = [v.name for v in views if v.name]
            self.filtered.record(uid, key, None, passing)
            return filter_result(args, passing, failed, unresolvable)
        self.workload.observe(request)
        if (hold := self._hold(args.pod)) is not None:
            if (error := hold_error(hold, self.config.queue_hold)) is not None:
                self.filtered.record(uid, key, request, [])
                return {**filter_result(args, [], failed, unresolvable), "Error": error}
            may_reserve = self._may_reserve_check(uid, key, request)
            passing, failed = hold_filter(
                hold, views, request, self.reservations, uid=uid, key=key, may_reserve=may_reserve
            )
            if not passing and hold.admitted is not None:
                passing, failed = self._hold_filter_again(
                    hold, args, views, request, uid=uid, key=key, may_reserve=may_reserve
                )
            if not passing and (error := plan_error(hold, failed, self.config.queue_hold)) is not None:
                self.filtered.record(uid, key, request, [])
                return {**filter_result(args, [], {}, {}), "Error": error}
            self.filtered.record(uid, key, request, passing)
            return filter_result(args, passing, failed, dict(failed))
        ctx = self._context(uid)
        positions, fits, _ = self._batch(views, request, ctx)
        passes = np.zeros(len(views), dtype=bool)
        passes[positions] = fits
        for pos in np.flatnonzero(~passes):
            view = views[pos]
            verdict = self._evaluate(view, request, ctx, score=False)
            if verdict.reason is None:
                passes[pos] = True
            else:
                failed[view.name or "<unnamed>"] = verdict.reason
        passing = [views[i].name for i in np.flatnonzero(passes)]
        self.filtered.record(uid, key, request, passing)
        if len(passing) == 1:
            # kube-scheduler skips prioritize when one node is left: reserve here instead.
            self._reserve_provisionally(views[int(np.flatnonzero(passes)[0])], uid, key, request, ctx)
        return filter_result(args, passing, failed, unresolvable)

    def _hold_filter_again(
        self,
        hold: Hold,
        args: ExtenderArgs,
        views: list[NodeView],
        request: Request,
        *,
        uid: str,
        key: str,
        may_reserve: Callable[[], bool],
    ) -> tuple[list[str], dict[str, str]]:
        names, on_demand, binder = args.node_names, self.on_demand, self.binder
        try:
            return hold_filter_again(
                hold, views, request, self.reservations, uid=uid, key=key, may_reserve=may_reserve,
                fresh_views=(lambda: on_demand.get_many_fresh(names)) if names and on_demand else None,
                read_pod=(lambda ns, name: binder.read_pod(namespace=ns, name=name)) if binder else None,
            )  # fmt: skip
        except KubeError as exc:
            log.warning("queued pod %s: its node looked at anew: %s (hint: %s)", key, exc, exc.hint)
            return hold_filter(
                hold, views, request, self.reservations, uid=uid, key=key, may_reserve=may_reserve
            )

    def _batch(
        self, views: list[NodeView], request: Request, ctx: _Context
    ) -> tuple[list[int], npt.NDArray[np.bool_], npt.NDArray[np.float64]]:
        """Fit and score of the nodes the batch form covers: (positions, fits, scores)."""
        return self.table.verdicts(
            views,
            request,
            uid=ctx.uid,
            known=self.nodes.views,
            reservations=self.reservations,
            reserved=ctx.reserved,
            workload=ctx.workload,
            version=ctx.version,
            policy=ctx.policy,
        )

    # ----- prioritize -----------------------------------------------------------------------------

    def prioritize(self, body: object) -> list[dict[str, Any]]:
        """Answer /prioritize: a HostPriorityList [{"Host", "Score"}], scores 0..10, for ExtenderArgs `body`.

        Nodes the pod does not fit, and every node when the pod has no (or an invalid) GPU request, score 0.
        Unless disabled, the best node gets a provisional reservation. Raises BadRequest for malformed `body`.
        """
        args = parse_args(body)
        views = self._views(args)
        try:
            uid, key, request = self._request(args.pod)
        except PlacementError:
            return [{"Host": v.name, "Score": 0} for v in views if v.name]
        if request is None:
            return [{"Host": v.name, "Score": 0} for v in views if v.name]
        if (hold := self._hold(args.pod)) is not None:  # the admission's node only; filter reserved its GPUs
            return hold_scores(hold, views, MAX_EXTENDER_PRIORITY)
        ctx = self._context(uid)
        positions, fits, values = self._batch(views, request, ctx)
        raw = np.full(len(views), np.nan)
        raw[np.array(positions, dtype=np.int64)[fits]] = values[fits]
        covered = np.zeros(len(views), dtype=bool)
        covered[positions] = True
        for pos in np.flatnonzero(~covered):
            scored = self._evaluate(views[pos], request, ctx, score=True).scored
            if scored is not None:
                raw[pos] = scored[0]
        scored_at = np.flatnonzero(~np.isnan(raw))
        if len(scored_at) and self.load_feed is not None:
            hosts = [views[i].name for i in scored_at]
            raw = blend(
                raw, scored_at, hosts, self.load_feed, self.config.energy_weight, self.config.load_weight
            )
        best = views[int(scored_at[raw[scored_at].argmax()])] if len(scored_at) else None
        scores = _scale_array(raw)
        result = [{"Host": v.name, "Score": int(s)} for v, s in zip(views, scores, strict=True) if v.name]
        if best is not None:
            self._reserve_provisionally(best, uid, key, request, ctx)
        return result

    def _may_reserve(self, uid: str, key: str, request: Request, *, queued: bool = False) -> bool:
        """Whether the pod may hold a provisional reservation: the API server has it, with this UID and this
        GPU request, pending and unbound (read through PendingPods, remembered a few seconds). `queued`: the
        GPUs of a queue admission's plan, reserved at filter even without provisional_reservations."""
        if not (queued or self.config.provisional_reservations) or self.pending is None:
            return False
        pod = self.pending.get(key)
        why = pod if isinstance(pod, str) else pending_reason(pod, key, uid)
        if why is None and pod is not None and not isinstance(pod, str):
            try:
                if request_from_pod(pod, memory_unit_bytes=self.config.memory_unit_bytes) != request:
                    why = f"pod {key} asks for other resources than the request body says"
            except PlacementError as exc:
                why = f"pod {key}: invalid GPU request: {exc}"
        if why is not None:
            log.debug("no provisional reservation: %s", why)
            return False
        return True

    def _may_reserve_check(self, uid: str, key: str, request: Request) -> Callable[[], bool]:
        """_may_reserve for this pod, asked only when a reservation is about to be made."""
        return lambda: self._may_reserve(uid, key, request, queued=True)

    def _reserve_provisionally(
        self, view: NodeView, uid: str, key: str, request: Request, ctx: _Context
    ) -> None:
        """Reserve the GPUs the pod would get on this node until its bind decides (or the TTL passes)."""
        if not self._may_reserve(uid, key, request):
            return
        state = self._state(view, uid)
        choice = score_node(state, request, policy=ctx.policy, workload=ctx.workload) if state else None
        if choice is not None:
            self.reservations.reserve(
                pod_uid=uid,
                pod_key=key,
                node=view.name,
                gpu_uuids=choice.gpu_uuids,
                request=request,
                final=False,
                annotation=view.fingerprint,
            )

    # ----- prioritize-claims (pods with ResourceClaims, drasteer.py) --------------------------------

    def prioritize_claims(self, body: object) -> list[dict[str, Any]]:
        """Answer /prioritize-claims: a HostPriorityList (0..10) ranking the nodes for a pod whose
        ResourceClaims ask gpunode's DRA devices, by the policy applied to each node's DRA GPUs as its
        claims hold them and as the answers to other pods whose claims are not allocated yet assume; []
        (kube-scheduler adds nothing) for any other pod, at once for a pod that names
        no claims. The answer is assumed (drasteer.Assumed) until the pod's claims are allocated; no
        reservation is made: kube-scheduler's allocator picks the devices. Raises BadRequest
        for malformed `body`.
        """
        args = parse_args(body)
        refs = pod_claim_refs(args.pod)
        claims = self.nodes.dra
        if not refs or claims is None:
            return []
        try:
            uid, _ = pod_key(args.pod)
        except InvalidRequest:
            return []
        kept = [claims.kept(ref) for ref in refs]
        request = claim_request(kept, pod_uid=uid, memory_unit_bytes=self.config.memory_unit_bytes)
        if request is None:
            return []
        self.workload.observe(request)
        views = self._views(args)
        ctx = self._context(uid)

        def allocated(ref: str) -> bool:
            claim = claims.kept(ref)
            return not isinstance(claim, DraClaim) or claim.allocated  # allocated, or gone

        assumed = self.assumed.live(allocated, skip_pod=uid)
        raw = np.full(len(views), np.nan)
        chosen: list[tuple[str, ...]] = [() for _ in views]
        for pos, view in enumerate(views):
            state = dra_state(view.state) if view.state is not None else None
            if state is None:
                continue
            try:
                choice = score_node(
                    with_assumed(state, assumed), request, policy=ctx.policy, workload=ctx.workload
                )
            except Exception as exc:  # one node's state never fails the request: it scores 0
                log.warning("node %s: its DRA GPUs could not be scored: %r", view.name, exc)
                continue
            if choice is not None:
                raw[pos] = choice.score
                chosen[pos] = choice.gpu_uuids
        scored_at = np.flatnonzero(~np.isnan(raw))
        if len(scored_at):
            best = int(scored_at[raw[scored_at].argmax()])
            mine = [ref for ref, k in zip(refs, kept, strict=True) if isinstance(k, DraClaim)]
            self.assumed.assume(uid, views[best].name, chosen[best], request, mine)
        scores = _scale_array(raw)
        return [{"Host": v.name, "Score": int(s)} for v, s in zip(views, scores, strict=True) if v.name]

    # ----- preempt --------------------------------------------------------------------------------

    def preempt(self, body: object) -> dict[str, Any]:
        """Answer /preempt: the ExtenderPreemptionResult for ExtenderPreemptionArgs `body` (preempt.py).

        No candidates for a GPU pod a queue governs (the queue controller alone preempts for queues), the
        candidates as sent for any other pod. Raises BadRequest when `body` is malformed.
        """
        namespaces = self.queue_namespaces()
        return answer_preemption(
            body,
            memory_unit_bytes=self.config.memory_unit_bytes,
            namespaces=namespaces,
            mark_key=self.mark_key,
        )

    # ----- bind -----------------------------------------------------------------------------------

    def bind(self, body: object) -> dict[str, str]:
        """Answer /bind with an ExtenderBindingResult {"Error"}: bind the pod to the node through the binder.

        The pod is read from the API server first and bound only when binding.check_bind approves it
        (pending, a scheduler served here, filtered onto that node); GPUs on the node are then reserved
        for its GPU request. "Error" is empty on success, else names why (a refused check, the pod no
        longer fits, no API access, the API refused). Raises BadRequest when `body` is not valid
        ExtenderBindingArgs.
        """
        args = parse_bind_args(body)
        if self.binder is None:
            return {"Error": "this extender has no Kubernetes API access to bind with (start it with --bind)"}
        try:
            pod = self.binder.read_pod(namespace=args.namespace, name=args.name)
        except KubeError as exc:
            return refuse(args, f"cannot read the pod: {exc}")
        verdict = check_bind(
            args,
            pod,
            filtered=self.filtered,
            schedulers=self.config.scheduler_names,
            memory_unit_bytes=self.config.memory_unit_bytes,
        )
        if not isinstance(verdict, Approved):
            return refuse(args, verdict)
        uid, node, key, request = verdict.uid, args.node, args.key, verdict.request
        made: Reservation | None = None
        planned: tuple[str, ...] | None = None
        if request is not None and (hold := self._hold(pod or {})) is not None:
            if hold.admitted is None:
                return refuse(args, f"pod {key} waits in queue {hold.queue}: {hold.reason}")
            if hold.admitted.node != node:
                return refuse(args, f"the queue controller admitted pod {key} to node {hold.admitted.node}")
            planned = hold.admitted.gpus
        if request is not None:
            policy = self.config.policy
            workload = self.workload.workload()
            if policy in NEEDS_WORKLOAD and workload is None:
                policy = "bestfit"
            decided = decide_and_reserve(
                locks=self._deciding,
                nodes=self.nodes,
                reservations=self.reservations,
                uid=uid,
                key=key,
                node=node,
                request=request,
                policy=policy,
                workload=workload,
                gpus=planned,
            )
            if isinstance(decided, str):
                return {"Error": decided}
            made = decided
        gpus = made.gpu_uuids if made is not None else ()
        try:
            self.binder.bind(namespace=args.namespace, name=args.name, uid=uid, node=node, gpu_uuids=gpus)
        except KubeError as exc:
            if made is not None:
                self.reservations.release(uid, only=made)  # its GPUs go back to the pods racing for them
            return {"Error": str(exc)}
        self.filtered.forget(uid)  # bound: a second bind of the same answer is refused
        if self.pending is not None:
            self.pending.forget(key)
        return {"Error": ""}


def _scale_array(raw: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Policy scores (NaN: does not fit) to 0..10 keeping their order: best 10, worst fitting 0, NaN 0."""
    out = np.zeros(len(raw), dtype=np.int64)
    ok = ~np.isnan(raw)
    if not ok.any():
        return out
    lo, hi = raw[ok].min(), raw[ok].max()
    if hi == lo:
        out[ok] = MAX_EXTENDER_PRIORITY
    else:
        out[ok] = np.rint((raw[ok] - lo) / (hi - lo) * MAX_EXTENDER_PRIORITY).astype(np.int64)
    return out
