"""The queue configuration file: the queue tree with its quotas, and the scheduler's settings.

API:
    load_queue_config(path) -> QueueConfig          read and validate a YAML file
    parse_queue_config(data, where) -> QueueConfig  validate decoded YAML (where: the file, for messages)
    QueueConfig.queues: dict[str, QueueSpec]        every queue in declaration order (parents first)
    QueueConfig.leaves / .root_names                the queues jobs go to / the tops of the tree
    QueueConfig.ancestors(name), .leaves_under(name), .limit(name)
    QueueConfig.fair_share (FairShareSettings), .preemption (PreemptionSettings), .backfill
    (BackfillSettings), .gang_timeout_s, .energy_weight, .placement_policy
    QueueConfig.namespaces: NamespaceMap            namespace -> the leaf queue its unlabelled pods wait in
                                                    (.kueue_label: kueue.queueNameLabel, see NamespaceMap)
    QueueSpec: name, parent, children, guarantee (Amounts), weight, borrow_limit (Amounts | None),
    priority, where

The simulator and the live controller read the same file. Every mistake is refused with
one QueueConfigError naming the key and the fix: an unknown key (with the closest known
one), a duplicate or unknown queue name, a cycle of `parent:` references, children
guaranteed more than their parent, a weight that is not positive, a negative quota, a
borrowing limit where nothing can be borrowed, bad units, a half-life that is not positive,
a namespace that is no DNS-1123 label or is mapped to a queue that is unknown or not a leaf.

Queues are given as a tree (`children:`) or as a flat list with `parent:` references, or
both. A guarantee is given per resource: `gpu` in GPUs (fractions down to 0.001),
`gpu_memory` as a size (64Gi), and `gpu/<model>` in GPUs of that model. A parent that does
not state a resource is guaranteed the sum of its children's for it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from gpunode.cluster.queueing.model import GPU, GPU_MEMORY, MODEL_PREFIX, Amounts, add
from gpunode.cluster.queueing.namespaces import read_namespaces
from gpunode.config.files import read_regular
from gpunode.config.reader import load_yaml
from gpunode.contract.names import MILLI_PER_GPU
from gpunode.contract.reader import MAX_DURATION_S, SectionReader, excerpt, format_bytes
from gpunode.errors import ConfigError, QueueConfigError
from gpunode.placement.batch import BATCH_POLICIES

MAX_FILE_BYTES = 1 << 20
MAX_QUEUES = 1000
MAX_DEPTH = 16
MAX_GPUS = 10**7
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_MODEL = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_QUEUE_KEYS = ("name", "parent", "guarantee", "weight", "borrowLimit", "priority", "children")


@dataclass(frozen=True)
class QueueSpec:
    """One queue: its place in the tree, what it is guaranteed, its weight above that, how far it may borrow.

    guarantee: per resource (model.Amounts units: milli-GPU, bytes); resources not listed are 0.
    borrow_limit: the most it may hold above its guarantee, per listed resource (None: unlimited;
    a resource missing from it is unlimited). priority: the default priority of its jobs.
    where: the queue's place in the file, for messages ("queues.yaml: queues[0].children[1]").
    """

    name: str
    parent: str | None
    children: tuple[str, ...]
    guarantee: Amounts
    weight: float
    borrow_limit: Amounts | None
    priority: int
    where: str = ""

    @property
    def leaf(self) -> bool:
        """A queue without children: jobs are submitted to leaves."""
        return not self.children


@dataclass(frozen=True)
class FairShareSettings:
    """Time-based fair share: usage decays with half_life_s, is forgotten after window_s; k weighs it."""

    half_life_s: float = 7200.0
    window_s: float = 86400.0
    k: float = 1.0


@dataclass(frozen=True)
class PreemptionSettings:
    """Preemption: the notice a victim gets, the runtime before a job may be preempted, which kinds are on."""

    notice_s: float = 300.0
    min_runtime_s: float = 600.0
    reclaim: bool = True
    priority: bool = True
    idle_first: bool = False  # take idle best-effort victims first (preempt.py)
    idle_minimum_s: float = 0.0  # how long a job must have been flagged idle before that counts
    # reclaim towards the fair share (preempt.py): from queues holding more than share_above x their
    # fair share, for a job of a queue below its own that has waited share_after_s; None: off
    share_above: float | None = 1.0
    share_after_s: float = 0.0
    # the share of the delivered GPU-time preemption losses may reach before share reclaim stops (lossbudget.py)
    share_loss_budget: float | None = 0.008
    # share reclaim makes room only off the nodes of backfill reservations that start before the preemptor ends
    share_keeps_reservations: bool = True


@dataclass(frozen=True)
class BackfillSettings:
    """EASY backfill, and the runtime assumed for a job that gives no estimate."""

    enabled: bool = True
    default_runtime_s: float = 3600.0
    reservations: int = 32  # jobs holding a reservation at once: the head of line, then multi-GPU jobs
    reservations_per_queue: int = 8  # the most of those further reservations the jobs of one leaf hold
    reserve_after_s: float = 0.0  # a job gets a further reservation only once it has waited this long
    # the reservations' jobs together ask at most this share of the cluster's GPUs (the head of line's
    # reservation always counts; a further one that would pass it waits)
    reserved_share: float = 0.1
    learn_estimates: bool = False  # runtime estimates corrected from each queue's completed jobs (history.py)
    # jobs without an estimate planned with their queue's learned runtime per size instead of default_runtime_s
    learn_missing: bool = False
    # a running job past its planned end is planned to run on for this share of what it has run (its
    # planned runtime grows by 1 + this share each time it is passed), not to end now; 0 (the default):
    # it is expected to end now. Off by default for the admission cycle's cost (docs/queueing.md)
    overdue_remaining: float = 0.0


@dataclass(frozen=True)
class OrderSettings:
    """A job's place in its queue: its arrival moved back by its size, so small jobs pass big ones briefly.

    shift = min(shift_per_gpu_hour_s x the GPU-hours it is planned to run, shift_max_s) (the runtime
    backfill plans it with: its estimate, corrected or learned when backfill.learnEstimates is on, or
    backfill.defaultRuntime). A big job is passed only by jobs that arrive less than its shift after it,
    so none waits behind later arrivals for ever. Only the gpunode preset reads it.

    shift_up_to_gpus (0: every job): only jobs asking at most this many GPUs in all are shifted; larger
    jobs and gangs keep their arrival as their place, so the short small jobs go first among the small
    ones while no later arrival ever passes a big job in its queue (its reservation comes as soon as with
    no shift at all).

    learned_size: the shift reads the runtime corrected from the queue's completed jobs (history.py, as
    backfill.learnEstimates computes it) even when backfill plans with the estimates as given, so a queue
    whose users under-estimate is ordered by what its jobs really run without moving any reservation.
    """

    shift_per_gpu_hour_s: float = 3600.0
    shift_max_s: float = 43200.0
    shift_up_to_gpus: int = 4
    learned_size: bool = False


class NamespaceMap(dict[str, str]):
    """`namespaces:` (namespace -> leaf queue), and `kueue.queueNameLabel`: whether the label
    kueue.x-k8s.io/queue-name on a pod, Job or JobSet names the gpunode queue of that name (gpunode's own
    label wins when both are there). Both say which queue an object waits in, so every reader of the map
    (the controller, its webhook, the extender's QueueNamespaces) reads them together."""

    kueue_label: bool = False


@dataclass(frozen=True)
class QueueConfig:
    """A validated queue configuration (see the module docstring)."""

    queues: dict[str, QueueSpec]
    fair_share: FairShareSettings = field(default_factory=FairShareSettings)
    preemption: PreemptionSettings = field(default_factory=PreemptionSettings)
    backfill: BackfillSettings = field(default_factory=BackfillSettings)
    order: OrderSettings = field(default_factory=OrderSettings)
    gang_timeout_s: float = 1800.0
    energy_weight: float = 0.0
    placement_policy: str = "gpunode"
    namespaces: NamespaceMap = field(default_factory=NamespaceMap)

    @cached_property
    def leaves(self) -> tuple[str, ...]:
        """The leaf queues, in declaration order."""
        return tuple(n for n, q in self.queues.items() if q.leaf)

    @cached_property
    def root_names(self) -> tuple[str, ...]:
        """The queues without a parent, in declaration order."""
        return tuple(n for n, q in self.queues.items() if q.parent is None)

    @cached_property
    def _chains(self) -> dict[str, tuple[str, ...]]:
        chains: dict[str, tuple[str, ...]] = {}
        for name, spec in self.queues.items():  # parents come first
            chains[name] = (name, *chains[spec.parent]) if spec.parent is not None else (name,)
        return chains

    @cached_property
    def _limits(self) -> dict[str, Amounts | None]:
        return {
            name: None
            if spec.borrow_limit is None
            else {k: spec.guarantee.get(k, 0) + v for k, v in spec.borrow_limit.items()}
            for name, spec in self.queues.items()
        }

    def ancestors(self, name: str) -> tuple[str, ...]:
        """The queue's parent, grandparent, ... up to its root (empty for a root)."""
        return self._chains[name][1:]

    def leaves_under(self, name: str) -> tuple[str, ...]:
        """The leaves in the subtree of `name` (itself if it is a leaf), in declaration order."""
        return tuple(leaf for leaf in self.leaves if name in self._chains[leaf])

    def limit(self, name: str) -> Amounts | None:
        """The most the queue may hold per limited resource (guarantee + borrowLimit); None: unlimited."""
        return self._limits[name]


def load_queue_config(path: str | Path) -> QueueConfig:
    """Read and validate a queue configuration file; every problem is one QueueConfigError."""
    where = str(path)
    try:
        raw = read_regular(path, MAX_FILE_BYTES)
    except OSError as exc:
        raise QueueConfigError(
            f"{where}: cannot read the queue configuration: {exc.strerror or exc}",
            hint="check the path given for the queue configuration file and that this user may read it",
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise QueueConfigError(
            f"{where}: the queue configuration is larger than {format_bytes(MAX_FILE_BYTES)}",
            hint="a queue configuration is a few kilobytes; check that the right file is given",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise QueueConfigError(
            f"{where}: the queue configuration is not UTF-8 text",
            hint="save the file as UTF-8 YAML",
        ) from None
    try:
        data = load_yaml(text, where=where)
    except QueueConfigError:
        raise
    except ConfigError as exc:
        raise QueueConfigError(str(exc), hint=exc.hint) from None
    return parse_queue_config(data, where)


def parse_queue_config(data: object, where: str) -> QueueConfig:
    """Validate decoded YAML (a mapping) into a QueueConfig; `where` names the file in messages."""
    top = SectionReader(data, f"{where}: ", error=QueueConfigError)
    items = top.items("queues")
    if not items:
        raise top.fail("queues", "expected at least one queue", hint="list the queues under queues:")
    queues = _read_tree(top, items)
    fair = top.section("fairShare")
    fair_share = FairShareSettings(
        half_life_s=_positive_duration(fair, "halfLife", 7200.0),
        window_s=_positive_duration(fair, "window", 86400.0),
        k=fair.number("k", 1.0, minimum=0, maximum=100),
    )
    fair.finish()
    pre = top.section("preemption")
    share_above, share_after_s, share_loss_budget, share_keeps = _share_reclaim(pre)
    preemption = PreemptionSettings(
        notice_s=pre.duration("notice", 300.0),
        min_runtime_s=pre.duration("minRuntime", 600.0),
        reclaim=pre.flag("reclaim", True),
        priority=pre.flag("priority", True),
        idle_first=pre.flag("idleFirst", False),
        idle_minimum_s=pre.duration("idleMinimum", 0.0),
        share_above=share_above,
        share_after_s=share_after_s,
        share_loss_budget=share_loss_budget,
        share_keeps_reservations=share_keeps,
    )
    pre.finish()
    back = top.section("backfill")
    backfill = BackfillSettings(
        enabled=back.flag("enabled", True),
        default_runtime_s=_positive_duration(back, "defaultRuntime", 3600.0),
        reservations=back.integer("reservations", 32, minimum=1, maximum=64),
        reservations_per_queue=back.integer("reservationsPerQueue", 8, minimum=0, maximum=64),
        reserve_after_s=back.duration("reserveAfter", 0.0),
        reserved_share=back.number("reservedShare", BackfillSettings.reserved_share, minimum=0, maximum=1),
        learn_estimates=back.flag("learnEstimates", BackfillSettings.learn_estimates),
        learn_missing=back.flag("learnMissing", BackfillSettings.learn_missing),
        overdue_remaining=back.number(
            "overdueRemaining", BackfillSettings.overdue_remaining, minimum=0, maximum=10
        ),
    )
    back.finish()
    sec = top.section("order")
    order = OrderSettings(
        shift_per_gpu_hour_s=sec.duration("shiftPerGpuHour", OrderSettings.shift_per_gpu_hour_s),
        shift_max_s=sec.duration("shiftMax", OrderSettings.shift_max_s),
        shift_up_to_gpus=sec.integer(
            "shiftUpToGpus", OrderSettings.shift_up_to_gpus, minimum=0, maximum=1_000_000
        ),
        learned_size=sec.flag("learnedSize", OrderSettings.learned_size),
    )
    sec.finish()
    gang = top.section("gang")
    gang_timeout_s = _positive_duration(gang, "timeout", 1800.0)
    gang.finish()
    energy = top.section("energy")
    energy_weight = energy.number("weight", 0.0, minimum=0, maximum=1)
    energy.finish()
    placement = top.section("placement")
    policy = placement.choice("policy", BATCH_POLICIES, "gpunode")
    placement.finish()
    namespaces = NamespaceMap(read_namespaces(top, {n: q.children for n, q in queues.items()}))
    kueue = top.section("kueue")
    namespaces.kueue_label = kueue.flag("queueNameLabel", False)
    kueue.finish()
    top.finish()
    return QueueConfig(
        queues=queues,
        fair_share=fair_share,
        preemption=preemption,
        backfill=backfill,
        order=order,
        gang_timeout_s=gang_timeout_s,
        energy_weight=energy_weight,
        placement_policy=policy,
        namespaces=namespaces,
    )


def _share_reclaim(pre: SectionReader) -> tuple[float | None, float, float | None, bool]:
    """preemption.shareReclaim: (above: a multiple of the fair share, after: a wait, lossBudget: a share of
    the delivered GPU-time or None, keepReservations); `false`: (None, the default after, None, default)."""
    d = PreemptionSettings()
    if pre.has("shareReclaim") and pre.raw("shareReclaim") is False:
        return None, d.share_after_s, None, d.share_keeps_reservations
    sec = pre.section("shareReclaim")
    above = sec.number("above", d.share_above, minimum=1, maximum=100)
    after = sec.duration("after", d.share_after_s)
    budget: float | None = None
    if sec.raw("lossBudget", d.share_loss_budget) is not False:  # false: no budget
        budget = sec.number("lossBudget", d.share_loss_budget, minimum=0, maximum=1)
    keeps = sec.flag("keepReservations", d.share_keeps_reservations)
    sec.finish()
    return above, after, budget, keeps


def _positive_duration(reader: SectionReader, key: str, default: float) -> float:
    seconds = reader.duration(key, default, maximum=MAX_DURATION_S)
    if seconds <= 0:
        raise reader.fail(key, "expected a duration above 0, got 0", hint=f"give {key} as e.g. 30m or 2h")
    return seconds


@dataclass
class _Raw:
    """A queue as read, before the tree is checked."""

    name: str
    where: str
    parent: str | None
    guarantee: Amounts
    weight: float
    borrow: Amounts | None
    priority: int | None
    children: list[str] = field(default_factory=list)


def _read_tree(top: SectionReader, items: list[object]) -> dict[str, QueueSpec]:
    raw: dict[str, _Raw] = {}
    stack: list[tuple[object, str, str | None, int]] = [
        (item, top.key_path(f"queues[{i}]"), None, 1) for i, item in reversed(list(enumerate(items)))
    ]
    while stack:  # depth first, in declaration order
        item, where, enclosing, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise QueueConfigError(
                f"{where}: queues nest more than {MAX_DEPTH} levels deep",
                hint="an org -> team tree is two or three levels; check the children lists",
            )
        q = SectionReader(item, where, error=QueueConfigError)
        queue = _read_queue(q, enclosing)
        if queue.name in raw:
            raise q.fail(
                "name",
                f"the queue name {queue.name} is given twice (first at {raw[queue.name].where})",
                hint="give every queue a name of its own",
            )
        raw[queue.name] = queue
        if len(raw) > MAX_QUEUES:
            raise top.fail("queues", f"more than {MAX_QUEUES} queues", hint="merge queues")
        kids = q.items("children", [])
        q.finish()
        for i, kid in reversed(list(enumerate(kids))):
            stack.append((kid, q.key_path(f"children[{i}]"), queue.name, depth + 1))
    for queue in raw.values():
        if queue.parent is not None and queue.parent not in raw:
            known = ", ".join(sorted(raw))
            raise QueueConfigError(
                f"{queue.where}.parent: no queue is named {queue.parent}",
                hint=f"name one of the queues: {known}",
            )
    _refuse_cycles(raw)
    for queue in raw.values():
        if queue.parent is not None:
            raw[queue.parent].children.append(queue.name)
    order = _parents_first(raw)
    _fill_and_check_guarantees(raw, order)
    roots = [q for q in raw.values() if q.parent is None]
    specs: dict[str, QueueSpec] = {}
    for name in order:
        queue = raw[name]
        if queue.borrow is not None and queue.parent is None and len(roots) == 1:
            raise QueueConfigError(
                f"{queue.where}.borrowLimit: {name} is the only top-level queue, so it has nobody to "
                "borrow from",
                hint="remove borrowLimit from the top-level queue; set it on the queues below it",
            )
        priority = queue.priority
        if priority is None:
            priority = 0 if queue.parent is None else specs[queue.parent].priority
        specs[name] = QueueSpec(
            name=name,
            parent=queue.parent,
            children=tuple(queue.children),
            guarantee=queue.guarantee,
            weight=queue.weight,
            borrow_limit=queue.borrow,
            priority=priority,
            where=queue.where,
        )
    return specs


def _read_queue(q: SectionReader, enclosing: str | None) -> _Raw:
    name = q.get("name", str)
    if not _NAME.fullmatch(name):
        raise q.fail(
            "name",
            f"{excerpt(name)} is not a valid queue name",
            hint="use 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
        )
    parent = q.get("parent", str, None)
    if parent is not None and enclosing is not None and parent != enclosing:
        raise q.fail(
            "parent",
            f"{name} is listed among the children of {enclosing} but names {parent} as its parent",
            hint="give a queue either in its parent's children or with parent:, not both ways differently",
        )
    if parent == name:
        raise q.fail("parent", f"{name} names itself as its parent", hint="name another queue, or none")
    weight = q.raw("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise q.fail("weight", f"expected a number above 0, got {excerpt(weight)}")
    if weight <= 0:
        raise q.fail(
            "weight",
            f"expected a number above 0, got {weight:g}",
            hint="a weight is the queue's share above the guarantees among its siblings: give e.g. 1",
        )
    priority = q.integer("priority", None, minimum=-(10**9), maximum=10**9)
    guarantee = _amounts(q, "guarantee") if q.has("guarantee") else {}
    borrow = _amounts(q, "borrowLimit") if q.has("borrowLimit") else None
    return _Raw(
        name=name,
        where=q.where,
        parent=parent if parent is not None else enclosing,
        guarantee=guarantee,
        weight=float(weight),
        borrow=borrow,
        priority=priority,
    )


def _amounts(q: SectionReader, key: str) -> Amounts:
    """A resource mapping: gpu (GPUs), gpu_memory (a size), gpu/<model> (GPUs) -> model.Amounts units."""
    r = q.section(key)
    out: Amounts = {}
    for resource in (GPU, *sorted(k for k in r.unread() if k.startswith(MODEL_PREFIX))):
        if not r.has(resource):
            continue
        if resource != GPU and not _MODEL.fullmatch(resource.removeprefix(MODEL_PREFIX)):
            raise r.fail(resource, "expected gpu/<model>, a GPU model name such as gpu/A100-SXM4-80GB")
        out[resource] = _milli_gpus(r, resource)
    if r.has(GPU_MEMORY):
        out[GPU_MEMORY] = r.size(GPU_MEMORY)
    r.finish()
    return out


def _milli_gpus(r: SectionReader, key: str) -> int:
    value = r.raw(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise r.fail(key, f"expected a number of GPUs such as 8 or 0.5, got {excerpt(value)}")
    if value < 0:
        raise r.fail(key, f"a quota cannot be negative, got {value:g}", hint="give 0 or more GPUs")
    if value > MAX_GPUS:
        raise r.fail(key, f"expected at most {MAX_GPUS} GPUs, got {value:g}")
    milli = value * MILLI_PER_GPU
    if abs(milli - round(milli)) > 1e-6:
        raise r.fail(key, f"GPUs are counted in thousandths, got {value!r}", hint="round to 0.001 GPU")
    return round(milli)


def _refuse_cycles(raw: Mapping[str, _Raw]) -> None:
    done: set[str] = set()
    for start in raw:
        path: list[str] = []
        on_path: set[str] = set()
        name: str | None = start
        while name is not None and name not in done:
            if name in on_path:
                cycle = [*path[path.index(name) :], name]
                raise QueueConfigError(
                    f"{raw[name].where}.parent: the queues {' -> '.join(cycle)} form a cycle",
                    hint="every chain of parent: references must end at a top-level queue",
                )
            path.append(name)
            on_path.add(name)
            name = raw[name].parent
        done.update(path)


def _parents_first(raw: Mapping[str, _Raw]) -> list[str]:
    order: list[str] = []
    stack = [q.name for q in reversed(list(raw.values())) if q.parent is None]
    while stack:
        name = stack.pop()
        order.append(name)
        stack.extend(reversed(raw[name].children))
    return order


def _fill_and_check_guarantees(raw: Mapping[str, _Raw], order: list[str]) -> None:
    """Parents without a resource get their children's sum; stated ones must cover the children."""
    for name in reversed(order):  # children before parents
        queue = raw[name]
        if not queue.children:
            continue
        kids = [raw[c] for c in queue.children]
        summed: Amounts = {}
        for kid in kids:
            summed = add(summed, kid.guarantee)
        for resource, amount in sorted(summed.items()):
            if resource not in queue.guarantee:
                queue.guarantee[resource] = amount
            elif amount > queue.guarantee[resource]:
                raise QueueConfigError(
                    f"{queue.where}.guarantee.{resource}: the children of {name} are guaranteed "
                    f"{_show(resource, amount)} in all, more than its own {_show(resource, queue.guarantee[resource])}",
                    hint=f"raise {name}'s guarantee or lower its children's ({', '.join(queue.children)})",
                )


def _show(resource: str, amount: int) -> str:
    if resource == GPU_MEMORY:
        return format_bytes(amount) if amount else "0"
    return f"{amount / MILLI_PER_GPU:g} GPUs"
