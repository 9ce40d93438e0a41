"""What a reconcile asks the API server for: annotations (with their Events), releases of gated pods and
evictions, by pod. No I/O."""

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

    annotate: list[Annotate] = field(default_factory=list)
    release: list[Release] = field(default_factory=list)  # after every annotation of the same job is written
    evict: list[PodRef] = field(default_factory=list)
    admitted_jobs: list[str] = field(default_factory=list)
    preempted_jobs: list[tuple[str, str]] = field(default_factory=list)  # (victim, reason)
    repairs: list[tuple[str, str]] = field(default_factory=list)  # (gang admitted part-way, outcome)


def ref(m: QueuedPod) -> PodRef:
    """The pod to write to for a queued pod."""
    return PodRef(m.namespace, m.name, m.uid)
