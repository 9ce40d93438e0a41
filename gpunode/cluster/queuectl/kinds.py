"""The objects the queue controller watches beside pods and Nodes, read as plain JSON: batch/v1 Jobs,
JobSets (jobset.x-k8s.io/v1alpha2, a CustomResourceDefinition that may not be installed) and
PriorityClasses (a Job's pod template names its class; the pod gets the value only when created).

Each is a msgspec struct that keeps the object's parts as JSON (no field is dropped, none is required),
with the API information the one Kubernetes client builds its paths from."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from lightkube.core.resource import ApiInfo, ResourceDef


class _Object(msgspec.Struct, omit_defaults=True):
    apiVersion: str = ""
    kind: str = ""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    spec: dict[str, Any] = msgspec.field(default_factory=dict)
    status: dict[str, Any] = msgspec.field(default_factory=dict)


class Job(_Object):
    """A batch/v1 Job."""

    _api_info: ClassVar[ApiInfo] = ApiInfo(
        resource=ResourceDef("batch", "v1", "Job"), plural="jobs", verbs=["list", "watch", "patch"]
    )


class JobSet(_Object):
    """A jobset.x-k8s.io/v1alpha2 JobSet."""

    _api_info: ClassVar[ApiInfo] = ApiInfo(
        resource=ResourceDef("jobset.x-k8s.io", "v1alpha2", "JobSet"),
        plural="jobsets",
        verbs=["list", "watch", "patch"],
    )


class PriorityClass(msgspec.Struct, omit_defaults=True):
    """A scheduling.k8s.io/v1 PriorityClass (its name and value)."""

    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    value: int = 0

    _api_info: ClassVar[ApiInfo] = ApiInfo(
        resource=ResourceDef("scheduling.k8s.io", "v1", "PriorityClass"),
        plural="priorityclasses",
        verbs=["list", "watch"],
    )
