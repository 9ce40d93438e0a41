"""Queued pods: which pods the queue controller holds, and its admission mark, read alike by both sides.

A GPU pod belongs to a queue when it carries the label gpunode.io/queue or its
namespace is mapped to a queue (the queue configuration's `namespaces:`; the
extender reads the controller's file with --queue-config, QueueNamespaces). Such a pod waits until the controller writes
gpunode.io/queue-admitted on it: JSON {"job", "uid", "node", "gpus", "at", "sig"}. The mark
counts only when its "uid" is the pod's own UID (a pod created with a mark already on
it cannot know the UID the API server will give it) and, with --admission-key-file, when
"sig" is the shared key's signature of it (gpunode.cluster.queuemark): the pod's owner may
patch its pod and read its UID, but cannot sign, nor reuse another pod's signed mark.

The extender holds a waiting pod by answering its filter with an Error (--queue-hold error, the
default: kube-scheduler then never preempts for it) or by failing every node (unschedulable), with the
controller's gpunode.io/queue-reason as the text kube-scheduler puts in the pod's
events (bounded and cleaned: the pod's owner can write that annotation too, and
gains nothing by it but a misleading message on their own pod). An admitted pod
passes filter only on the node of its mark, and bind reserves exactly the GPUs the
mark names (admitted_filter, marked_fit): the controller's plan wins over the
extender's own choice. When that node does not pass (the plan no longer fits), the
filter answers as for a waiting pod: an Error saying why (plan_error), or failed nodes
(unschedulable), and the controller re-plans. This module is the one place both sides read these marks;
gpunode.cluster.queuectl imports it. No I/O but QueueNamespaces' reading of its file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from gpunode.cluster.extender.nodes import NodeView
from gpunode.cluster.extender.reservations import Reservations, apply_reservations, gone_reason
from gpunode.cluster.queueing.config import MAX_FILE_BYTES, load_queue_config
from gpunode.cluster.queuemark import UNSIGNED_WARNING, MarkKey, mark_accepted
from gpunode.config.files import read_regular
from gpunode.contract.names import (
    KUEUE_QUEUE_LABEL,
    QUEUE_ADMITTED_ANNOTATION,
    QUEUE_LABEL,
    QUEUE_REASON_ANNOTATION,
)
from gpunode.errors import InvalidState, QueueConfigError
from gpunode.placement import NodeState, Request, apply_request

log = logging.getLogger(__name__)
_unsigned_warned = threading.Event()


def warn_unsigned_once() -> None:
    """Log, once per process, that queue admissions are taken unsigned (no --admission-key-file)."""
    if not _unsigned_warned.is_set():
        _unsigned_warned.set()
        log.warning("extender: %s", UNSIGNED_WARNING)


WAITING_REASON = "waiting for admission by the queue controller"
HOLD_ERROR = "error"  # --queue-hold: a held pod's filter answers Error (no preemption on any version)
HOLD_UNSCHEDULABLE = "unschedulable"  # failed nodes (the scheduler must call preempt or honour unresolvable)
HOLD_MODES = (HOLD_ERROR, HOLD_UNSCHEDULABLE)
MAX_REASON = 200  # characters of the controller's reason shown in the pod's events
MAX_MARK = 64 * 1024  # characters of a JSON mark read at all


@dataclass(frozen=True)
class Admitted:
    """The admission written on one pod: its job and where the plan puts it."""

    job: str
    node: str
    gpus: tuple[str, ...]
    at: float


def parse_time(text: object) -> float | None:
    """RFC 3339 text -> seconds since the epoch; None when absent or unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def json_mark(text: object) -> Mapping[str, Any] | None:
    """An annotation holding a JSON object, or None when absent, too long or not one."""
    if not isinstance(text, str) or len(text) > MAX_MARK:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, Mapping) else None


def read_admitted(text: object, uid: str, key: MarkKey | None, *, where: str = "") -> Admitted | None:
    """The admission annotation, or None when absent or not the controller's (then the pod is not admitted):
    another pod's UID, or with `key` a missing or wrong signature (logged once per pod, naming `where`)."""
    data = json_mark(text)
    if data is None or not mark_accepted(data, uid, key, where=where or uid, text=str(text)):
        return None
    job, node, gpus, at = data.get("job"), data.get("node"), data.get("gpus"), parse_time(data.get("at"))
    if not isinstance(job, str) or not isinstance(node, str) or not isinstance(gpus, list):
        return None
    if not all(isinstance(g, str) for g in gpus):
        return None
    return Admitted(job=job, node=node, gpus=tuple(gpus), at=at or 0.0)


def queue_of(pod: Mapping[str, Any], namespaces: Mapping[str, str]) -> str | None:
    """The queue a pod (or a Job, a JobSet) names, or None: its label gpunode.io/queue first, then, when
    the configuration's kueue.queueNameLabel is true (`namespaces` is its NamespaceMap), the label
    kueue.x-k8s.io/queue-name, then its namespace's mapping."""
    meta = pod.get("metadata") or {}
    if not isinstance(meta, Mapping):
        return None
    labels = meta.get("labels") or {}
    labels = labels if isinstance(labels, Mapping) else {}
    queue = labels.get(QUEUE_LABEL)
    if isinstance(queue, str) and queue:
        return queue
    if getattr(namespaces, "kueue_label", False):
        queue = labels.get(KUEUE_QUEUE_LABEL)
        if isinstance(queue, str) and queue:
            return queue
    return namespaces.get(str(meta.get("namespace") or "default"))


def clean_reason(text: object) -> str:
    """The controller's waiting reason fit for an event: one line of printable text, at most MAX_REASON
    characters; WAITING_REASON when absent or empty."""
    if not isinstance(text, str):
        return WAITING_REASON
    text = text[: MAX_REASON * 4]
    kept = "".join(" " if unicodedata.category(c)[0] in "CZ" else c for c in text)
    line = " ".join(kept.split())
    if len(line) > MAX_REASON:
        line = line[: MAX_REASON - 3].rstrip() + "..."
    return line or WAITING_REASON


@dataclass(frozen=True)
class Hold:
    """What the queue says about a GPU pod: `admitted` (go where it says) or `reason` (wait)."""

    queue: str
    admitted: Admitted | None
    reason: str  # "" when admitted


def queue_hold(pod: Mapping[str, Any], namespaces: Mapping[str, str], key: MarkKey | None) -> Hold | None:
    """The queue's hold on a GPU pod, None when no queue governs it (then it is scheduled as any pod).
    `key`: the admission marks' key (None: marks are taken unsigned, by UID alone).

    Call only for pods that ask for GPUs (request_from_pod is not None): the controller queues those only.
    """
    queue = queue_of(pod, namespaces)
    if queue is None:
        return None
    if key is None:  # a queued pod met with no key (queues by label need no --queue-config to exist)
        warn_unsigned_once()
    meta = pod.get("metadata") or {}
    notes = meta.get("annotations") if isinstance(meta, Mapping) else None
    notes = notes if isinstance(notes, Mapping) else {}
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    where = (
        f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}" if isinstance(meta, Mapping) else ""
    )
    admitted = read_admitted(
        notes.get(QUEUE_ADMITTED_ANNOTATION), uid if isinstance(uid, str) else "", key, where=where
    )
    if admitted is not None:
        return Hold(queue=queue, admitted=admitted, reason="")
    return Hold(queue=queue, admitted=None, reason=clean_reason(notes.get(QUEUE_REASON_ANNOTATION)))


def marked_fit(state: NodeState, request: Request, node: str, gpus: tuple[str, ...]) -> str | None:
    """Why the GPUs an admission names on `node` no longer take the pod in this state; None when they do."""
    try:
        apply_request(state, request, gpus)
    except InvalidState as exc:
        return (
            f"the queue controller's plan (node {node}, GPUs {','.join(gpus) or 'none'}) no longer fits: "
            f"{exc}; waiting for the queue controller to re-plan"
        )
    return None


def admitted_filter(
    views: Iterable[NodeView], admitted: Admitted, request: Request, reservations: Reservations, uid: str
) -> tuple[NodeView | None, dict[str, str]]:
    """(the node of the admission when the pod still fits its GPUs there, else None; every other node with
    why it fails). The node's live reservations count, but the pod's own."""
    chosen: NodeView | None = None
    failed: dict[str, str] = {}
    for view in views:
        if not view.name:
            continue
        if view.name != admitted.node:
            failed[view.name] = f"the queue controller admitted this pod to node {admitted.node}"
            continue
        state = apply_reservations(view, reservations, skip_pod=uid)
        if state is None:
            failed[view.name] = view.reason or "no usable GPU state"
        elif (why := marked_fit(state, request, admitted.node, admitted.gpus)) is not None:
            failed[view.name] = why
        else:
            chosen = view
    return chosen, failed


class QueueNamespaces:
    """The `namespaces:` map of the queue controller's configuration file, re-read when the file changes.

    Raises QueueConfigError at construction for a bad file; later, a bad or unreadable file is logged and
    the map read before stays (as the controller keeps its running configuration). Thread safe.
    """

    def __init__(
        self, path: str | Path, *, check_every_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path)
        self.check_every_s = check_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._digest, self._refused = self._read_digest(), b""
        self._map: Mapping[str, str] = load_queue_config(self.path).namespaces
        self._checked = clock()

    def _read_digest(self) -> bytes:
        try:
            return hashlib.sha256(read_regular(self.path, MAX_FILE_BYTES)).digest()
        except OSError:
            return b""

    def get(self) -> Mapping[str, str]:
        """The namespace -> queue map (checked against the file at most every check_every_s seconds)."""
        now = self._clock()
        if now - self._checked < self.check_every_s or not self._lock.acquire(blocking=False):
            return self._map  # someone else is checking: the map in hand is good enough
        try:
            self._checked = now
            digest = self._read_digest()
            if digest and digest != self._digest and digest != self._refused:
                try:
                    self._map = load_queue_config(self.path).namespaces
                    self._digest = digest
                    log.info(
                        "queue configuration %s re-read: %d namespace(s) mapped", self.path, len(self._map)
                    )
                except QueueConfigError as exc:
                    self._refused = digest
                    log.warning("queue configuration refused, the namespace map read before stays: %s", exc)
            return self._map
        finally:
            self._lock.release()


def hold_error(hold: Hold, mode: str) -> str | None:
    """The filter's Error for a held pod in mode HOLD_ERROR (the queue's reason), None when the filter is to
    answer with failed nodes instead (mode HOLD_UNSCHEDULABLE) or is admitted (plan_error then).

    kube-scheduler returns an extender's Error as a plain scheduling error, not a fit error: no PostFilter,
    so its own preemption never runs for the pod, whether or not it calls the preempt verb. The event and
    the pod's condition show the text as is, but 1.20 reads it as a Go format string: '%' (the pod's owner
    can write the reason) is shown as a fullwidth percent sign rather than garbled."""
    if hold.admitted is not None or mode != HOLD_ERROR:
        return None
    return _error_text(hold.reason)


def plan_error(hold: Hold, failed: Mapping[str, str], mode: str) -> str | None:
    """The filter's Error for an admitted pod that passed no node, in mode HOLD_ERROR: why the node of its
    admission did not pass (`failed`, hold_filter's), cleaned as a waiting reason; None for a waiting pod
    or in mode HOLD_UNSCHEDULABLE (then the failed nodes are the answer).

    Failed nodes would make kube-scheduler's own preemption run for the pod (a plan that no longer fits
    because something took its GPUs is a fit failure on every node), so a pod whose owner gave it a high
    PriorityClass could have the GPUs' new holders evicted; with an Error it waits for the controller to
    re-plan. The node names and GPUs come from the mark, which the pod's owner can rewrite: cleaned too."""
    if hold.admitted is None or mode != HOLD_ERROR:
        return None
    node = hold.admitted.node
    why = failed.get(node) or (
        f"the queue controller's plan names node {node}, which kube-scheduler did not offer (its own "
        "filters failed it, or it is gone); waiting for the queue controller to re-plan"
    )
    return _error_text(clean_reason(why))


def _error_text(reason: str) -> str:
    """A cleaned reason as an extender Error: 1.20 reads it as a Go format string, so '%' is shown as '\uff05'."""
    return reason.replace("%", "\uff05")


def hold_filter(
    hold: Hold,
    views: list[NodeView],
    request: Request,
    reservations: Reservations,
    *,
    uid: str,
    key: str,
    may_reserve: Callable[[], bool] = lambda: True,
) -> tuple[list[str], dict[str, str]]:
    """Filter of a queued pod: (the nodes that pass, the others with why). Waiting: none passes, every node
    shows the controller's reason. Admitted: the admission's node alone, where the plan's GPUs are then
    reserved (provisionally, until bind, when `may_reserve()`: the pod exists and waits) so that no other
    pod takes them meanwhile."""
    if hold.admitted is None:
        return [], {v.name: hold.reason for v in views if v.name}
    chosen, failed = admitted_filter(views, hold.admitted, request, reservations, uid)
    if chosen is None:
        return [], failed
    if not may_reserve():
        return [chosen.name], failed
    reservations.reserve(
        pod_uid=uid,
        pod_key=key,
        node=chosen.name,
        gpu_uuids=hold.admitted.gpus,
        request=request,
        final=False,
        annotation=chosen.fingerprint,
    )
    return [chosen.name], failed


def hold_filter_again(
    hold: Hold,
    views: list[NodeView],
    request: Request,
    reservations: Reservations,
    *,
    uid: str,
    key: str,
    fresh_views: Callable[[], list[NodeView]] | None,
    read_pod: Callable[[str, str], Mapping[str, Any] | None] | None,
    may_reserve: Callable[[], bool] = lambda: True,
) -> tuple[list[str], dict[str, str]]:
    """hold_filter once more for an admitted pod whose plan failed, with what may lag behind looked at anew.

    The controller admits onto GPUs the nodes' annotations show free, and kube-scheduler retries the pod once
    for that, at once: the extender's view may be older. So the nodes come from a fresh list (`fresh_views`,
    names-only mode), and the bound reservations on the admission's node whose pods are gone (read now with
    `read_pod(namespace, name)`) are released: a pod deleted soon after its bind keeps its reservation until
    the next periodic check otherwise. `read_pod` may raise KubeError (the caller's to answer)."""
    assert hold.admitted is not None
    if fresh_views is not None:
        views = fresh_views()
    on_node = [r for r in reservations.bound() if r.node == hold.admitted.node and r.pod_uid != uid]
    for r in on_node:
        if read_pod is None:
            break
        namespace, _, name = r.pod_key.partition("/")
        why = gone_reason(read_pod(namespace, name), r)
        if why is not None and reservations.release(r.pod_uid, only=r):
            log.info("reservation of pod %s on node %s released: %s", r.pod_key, r.node, why)
    return hold_filter(hold, views, request, reservations, uid=uid, key=key, may_reserve=may_reserve)


def hold_scores(hold: Hold, views: Iterable[NodeView], best: int) -> list[dict[str, Any]]:
    """Prioritize of a queued pod: `best` for the admission's node, 0 for every other node."""
    planned = hold.admitted.node if hold.admitted is not None else None
    return [{"Host": v.name, "Score": best if v.name == planned else 0} for v in views if v.name]
