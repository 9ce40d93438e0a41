"""The one Kubernetes client of gpunode: asyncio, typed, with list+watch.

The node agent (evictions, Events, its Node's annotations, labels, taints and
conditions), the scheduler extender (annotate a pod, bind it, list nodes) and
controllers (watch) all use KubeClient. Credentials come from an explicit
address, the in-cluster service account or a kubeconfig (gpunode.infra.kube.config);
every failure is one of the KubeError subclasses of gpunode.errors. This package imports
nothing from gpunode.node or gpunode.cluster.

Modules: client (KubeClient), lease (leader election on a Lease), transport (the request path and error
translation), watch (list+watch), config (credentials), models (value types).
"""

from gpunode.infra.kube.client import COMPONENT, KubeClient
from gpunode.infra.kube.config import DEFAULT_REQUEST_TIMEOUT_S, SERVICE_ACCOUNT_DIR
from gpunode.infra.kube.lease import (
    ElectionConfig,
    LeaderElector,
    LeaseLock,
    LeaseRecord,
    candidate_identity,
)
from gpunode.infra.kube.models import (
    ADDED,
    DELETED,
    MODIFIED,
    SYNC,
    NodeCondition,
    ObjectRef,
    PodInfo,
    Taint,
    WatchEvent,
)
from gpunode.infra.kube.transport import RBAC_HINT, is_retryable, resource_path

__all__ = [
    "ADDED",
    "COMPONENT",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DELETED",
    "MODIFIED",
    "RBAC_HINT",
    "SERVICE_ACCOUNT_DIR",
    "SYNC",
    "ElectionConfig",
    "KubeClient",
    "LeaderElector",
    "LeaseLock",
    "LeaseRecord",
    "NodeCondition",
    "ObjectRef",
    "PodInfo",
    "Taint",
    "WatchEvent",
    "candidate_identity",
    "is_retryable",
    "resource_path",
]
