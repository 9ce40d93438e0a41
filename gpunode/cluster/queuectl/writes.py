"""What a reconcile asks the API server for: patches of Jobs and JobSets (admission by resuming, suspension,
notices), annotations (with their Events), releases of gated pods and evictions, by pod. No I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpunode.cluster.queuectl.jobs import QueuedPod


@dataclass(frozen=True)
class PodRef:
    """One pod to write to."""

    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Annotate:
    """Set annotations of one pod (None removes one), with an Event (reason, message) when given."""

    pod: PodRef
    annotations: Mapping[str, str | None]
    event: tuple[str, str] | None = None
    warning: bool = False
    job: str = ""


@dataclass(frozen=True)
class Release:
    """Pin a gated pod to its planned node and remove the admission gate (gates.release_spec), once every
    member of `job` carries its admission mark."""

    pod: PodRef
    node: str
    spec: Mapping[str, object]
    job: str = ""


@dataclass
class Actions:
    """What one reconcile asks the API server for, in this order."""

    patch: list[Patch] = field(default_factory=list)  # Jobs and JobSets: first, each alone
    annotate: list[Annotate] = field(default_factory=list)
    release: list[Release] = field(default_factory=list)  # after every annotation of the same job is written
    evict: list[PodRef] = field(default_factory=list)
    admitted_jobs: list[str] = field(default_factory=list)
    preempted_jobs: list[tuple[str, str]] = field(default_factory=list)  # (victim, reason)
    repairs: list[tuple[str, str]] = field(default_factory=list)  # (gang admitted part-way, outcome)


def ref(m: QueuedPod) -> PodRef:
    """The pod to write to for a queued pod."""
    return PodRef(m.namespace, m.name, m.uid)


@dataclass(frozen=True)
class WorkloadRef:
    """One Job or JobSet to write to."""

    kind: str  # "Job" | "JobSet"
    api_version: str
    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        """Kind namespace/name."""
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True)
class Patch:
    """One merge patch of a Job or JobSet: annotations (None removes one) and spec.suspend (None: left as it
    is), in one write; then an Event about it when given, and for a Job the condition `condition`
    (type QueueRefused: reason, message) on its status."""

    target: WorkloadRef
    annotations: Mapping[str, str | None]
    suspend: bool | None = None
    event: tuple[str, str] | None = None
    warning: bool = False
    job: str = ""
    condition: tuple[str, str] | None = None
