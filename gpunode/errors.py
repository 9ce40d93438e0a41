"""The one exception tree of gpunode.

Every error that can stop the agent or a command derives from GpunodeError. Each
carries three things the caller renders as it sees fit:

- str(exc): the message, one line naming the problem (log lines stay whole);
- exc.hint: one sentence telling the operator what to do about it;
- exc.exit_code: the status `gpunode` exits with (2 for configuration errors, 1 otherwise).

Errors from third-party libraries (NVML, gRPC, HTTP, YAML) are translated into this
tree at the edge where they occur; nothing else in the package should let a
foreign exception escape to the user. This module imports nothing of gpunode, so
every layer can raise from it.
"""

from __future__ import annotations

# -- base ---------------------------------------------------------------------------------------


class GpunodeError(Exception):
    """Base class: str() is the one-line message, `hint` the remedy, `exit_code` the CLI status."""

    default_hint = "see `gpunode doctor` for a diagnosis of this node"
    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(one_line(message))
        self.hint = one_line(hint or self.default_hint)


def one_line(text: str) -> str:
    """`text` on one line, its lines stripped and joined by spaces: text from other libraries (YAML, HTTP
    bodies, parser errors) may span lines; a message or log line never does."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


class MissingExtra(GpunodeError):
    """A command needs a package of an optional extra (pyproject's optional-dependencies) that is not installed."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package {module!r}, which is not installed",
            hint=f"install the '{extra}' extra: pip install 'gpunode[{extra}]'",
        )
        self.module, self.extra = module, extra


class HealthStateError(GpunodeError):
    """The health state directory (held faults, operator clears) cannot be read or written."""

    default_hint = "check that --state-dir (gpunode.stateDir) exists and that this user may write it"


class ConfigError(GpunodeError):
    """Invalid configuration: a file, an environment variable or a flag."""

    default_hint = (
        "fix the named key; `gpunode devices --config FILE` validates a file without starting anything"
    )
    exit_code = 2


class ProfileError(ConfigError):
    """A simulated-node profile that cannot be loaded."""

    default_hint = "check the profile against the bundled ones (gpunode/node/devices/simnode/profiles/*.yaml)"


# -- the node: devices, allocation, memory caps, metrics -----------------------------------------


class BackendError(GpunodeError):
    """The device backend could not be initialised or queried."""

    default_hint = "run `gpunode doctor` to check the NVIDIA driver and NVML"


class BackendUnavailable(BackendError):
    """No usable backend: NVML missing, or no GPU present."""

    default_hint = (
        "install the NVIDIA driver (libnvidia-ml.so.1) on a GPU node, "
        "or pass --backend sim to run on a simulated node"
    )


class GpuLostError(BackendError):
    """A GPU fell off the bus or stopped answering (NVML_ERROR_GPU_IS_LOST and kin)."""

    default_hint = (
        "the GPU needs a reset or a reboot; its devices are marked unhealthy until it answers again"
    )

    def __init__(self, uuid: str, message: str | None = None) -> None:
        super().__init__(message or f"GPU {uuid} is lost")
        self.uuid = uuid


class DeviceNotFound(GpunodeError):
    """A device ID, GPU UUID or index that does not exist on this node."""

    default_hint = "list the node's devices with `gpunode devices`"


class SimFaultError(GpunodeError):
    """A fault or process request the simulated node cannot carry out."""

    default_hint = "list the simulated GPUs with `gpunode sim list --socket PATH` and check the request"


class SimControlError(GpunodeError):
    """The control socket of a simulated node cannot be served or reached, or refused a request."""

    default_hint = (
        "start the agent with --backend sim and pass the control socket it reports to --socket; "
        "`gpunode sim list --socket PATH` shows the GPUs"
    )


class AgentPartFailed(GpunodeError):
    """A part of the running agent (device plugins, metrics, health, ...) failed in an unexpected way."""

    default_hint = (
        "the agent stopped so that its supervisor (systemd, the DaemonSet) restarts it; "
        "the log lines above say more, and `gpunode doctor` checks the node"
    )


class KubeletDirError(ConfigError):
    """The kubelet's device-plugins directory (--kubelet-dir, gpunode.kubeletDir) cannot be served from."""

    default_hint = (
        "point --kubelet-dir (gpunode.kubeletDir) at the kubelet's device-plugins directory, "
        "usually /var/lib/kubelet/device-plugins, mounted read-write"
    )


class StateDirError(ConfigError):
    """The agent's state directory (--state-dir, gpunode.stateDir) is not a writable directory."""

    default_hint = (
        "set --state-dir (gpunode.stateDir, GPUNODE_STATE_DIR) to a writable directory on the host, "
        "e.g. /var/lib/gpunode mounted read-write"
    )


class AllocationError(GpunodeError):
    """A request the device plugin must refuse (unknown/unhealthy device, too many devices, ...)."""

    default_hint = "check the pod's resource request against `gpunode devices`"


class ClaimRefused(AllocationError):
    """A ResourceClaim the DRA kubelet plugin cannot prepare: its allocation, its device or its
    configuration. Reported for that claim alone; the other claims of the call go on."""

    default_hint = "check the claim's allocation and its opaque configuration for the gpunode driver"


class MemcapError(GpunodeError):
    """The memory-cap region or the native library is unusable."""

    default_hint = "reinstall gpunode so that the native library and the CFFI module are rebuilt"


class RegionDamaged(MemcapError):
    """One memory-cap region's files are unusable: a usage file that a container truncated, removed or
    rewrote (the usage file is mounted read-write into it), or a limit file damaged on the host.

    `key` names the region; `reason` says what is wrong, as a metric label: truncated, missing, corrupt,
    leased (a file lease held on the usage file), limit or io.
    """

    default_hint = (
        "only that container's cap is affected and the agent skips its region; restart the pod "
        "(its next Allocate gets a fresh region) or delete it (the region is then garbage-collected)"
    )

    def __init__(self, message: str, *, key: str, reason: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.key = key
        self.reason = reason


class InvalidComputeShare(GpunodeError, ValueError):
    """A compute share that is zero, negative, above one GPU, not a number, or finer than a thousandth."""

    default_hint = "give gpunode.io/gpu-milli as a whole number of thousandths of a GPU, from 1 to 1000"
    exit_code = 2


# -- servers and Kubernetes ---------------------------------------------------------------------


class BodyRefused(GpunodeError):
    """The HTTP layer will not take a request body: `status` 413 (over the per-request limit) or 503
    (the server's budget for bodies in flight is spent). Answered to the client, never raised to a user."""

    default_hint = "send a smaller body; on 503, retry after a moment"

    def __init__(self, message: str, *, status: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class ListenError(GpunodeError):
    """An HTTP server could not listen on its address."""

    default_hint = "choose another address, or stop the process that already listens there"


class MetricsServerError(ListenError):
    """The metrics endpoint could not listen."""

    default_hint = "choose another gpunode.metrics.listen address, or stop what already listens there"


class TlsConfigError(ConfigError):
    """A TLS certificate, key or CA file that cannot be read or does not fit (gpunode.infra.http)."""

    default_hint = (
        "give a readable PEM certificate chain and the private key that belongs to it "
        "(openssl x509 -noout -pubkey -in CERT and openssl pkey -pubout -in KEY must print the same key)"
    )


class WebConfigError(ConfigError):
    """An exporter-toolkit web configuration file (--web-config-file) that cannot be used."""

    default_hint = (
        "fix the named key; the format is that of prometheus/exporter-toolkit docs/web-configuration.md"
    )


class KubeError(GpunodeError):
    """A Kubernetes API or kubelet API call failed."""

    default_hint = "check the agent's service account RBAC and that the API server is reachable"


class KubeApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(self, message: str, *, status: int, reason: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.reason = reason


class KubeNotFound(KubeApiError):
    """404: the object does not exist (any more)."""


class KubeConflict(KubeApiError):
    """409: a precondition (UID, resourceVersion) did not hold."""


class EvictionBlocked(KubeApiError):
    """429 on an eviction: a PodDisruptionBudget does not allow it now."""

    default_hint = "the eviction is retried until the deadline; check the pod's PodDisruptionBudget"

    def __init__(self, message: str, *, retry_after_s: float | None) -> None:
        super().__init__(message, status=429, reason="TooManyRequests")
        self.retry_after_s = retry_after_s


class KubeUnreachable(KubeError):
    """No answer: connection refused, reset, or the request timed out."""

    default_hint = "check that the API server is reachable from the node (network policy, proxy, DNS)"


class NotLeader(KubeError):
    """This extender replica does not hold the leader Lease (long enough) to write to the API server."""

    default_hint = "kube-scheduler retries the pod; the leader replica serves it (docs/scheduler.md, HA)"


# -- the node-state contract and placement ------------------------------------------------------


class NodeStateError(GpunodeError):
    """A node GPU-state annotation that cannot be used: broken JSON, a bad field, an unknown version."""

    default_hint = (
        "the gpunode agent on that node publishes this annotation; check that it runs and that its "
        "version matches the extender's (gpunode.io/gpu-state must be version v1)"
    )


class PlacementError(GpunodeError, ValueError):
    """Base of placement's errors; also a ValueError, as bad arguments are."""

    default_hint = "check the pod's GPU request and the node's published GPU state"


class QuantityError(GpunodeError, ValueError):
    """A Kubernetes resource quantity that does not read (grammar, size, sign); callers re-raise it as
    their own error with the place named."""

    default_hint = "write a Kubernetes quantity such as 500m, 2, 16Gi or 1e3 (at most 2^63-1, not negative)"


class InvalidRequest(PlacementError):
    """A request that no GPU could ever satisfy as written (negative, mixed kinds, ...)."""

    default_hint = (
        "ask for exactly one kind of GPU resource per pod: whole GPUs (nvidia.com/gpu), a fraction "
        "(gpunode.io/gpu-memory and/or gpunode.io/gpu-milli) or one MIG profile (nvidia.com/mig-<profile>)"
    )


class InvalidState(PlacementError):
    """A node or GPU state that contradicts itself (more free than total, duplicate UUIDs, ...)."""

    default_hint = "the node's GPU state is inconsistent; check the agent that published it (gpunode devices)"


class Unsatisfiable(PlacementError):
    """A request that the given GPUs cannot satisfy (too few, or the required ones are missing)."""

    default_hint = "the node does not have enough free GPUs of the requested kind for this request"


# -- the cluster: extender and trace simulator --------------------------------------------------


class QueueConfigError(ConfigError):
    """An invalid queue configuration file: the queue tree, quotas, fair share or preemption settings."""

    default_hint = "fix the named key of the queue configuration; docs/queueing.md describes every key"


class QueueUsageRefused(GpunodeError):
    """The fair-share usage the queue controller saved (a ConfigMap) cannot be trusted: it starts without."""

    default_hint = (
        "only the queue controller writes this ConfigMap: delete it (the leader writes it afresh) and "
        "check who else may write ConfigMaps in its namespace"
    )


class AdmissionKeyError(ConfigError):
    """The key that signs queue admission marks (--admission-key-file) cannot be read or is too short."""

    default_hint = (
        "give `gpunode queue` and `gpunode extender` the same file of at least 32 random bytes, e.g. "
        "`head -c 48 /dev/urandom | base64 > key` (the chart keeps one in the Secret "
        "<release>-queue-admission-key)"
    )


class SimRulesError(ConfigError):
    """An invalid rules file of the time simulator (how trace pods become queued jobs)."""

    default_hint = (
        "fix the named key of the simulator rules; gpunode/examples/sim-rules.yaml documents every key"
    )


class BadRequest(GpunodeError):
    """An HTTP request the extender cannot read (broken JSON, wrong shape); answered with 400."""

    default_hint = "kube-scheduler sends ExtenderArgs JSON; check the extender's urlPrefix and verbs"


class MetricsFeedError(GpunodeError):
    """Prometheus's answer to the extender's metric queries cannot be used (unreachable, slow, malformed)."""

    default_hint = "check --prometheus-url and that this Prometheus scrapes the agents' DCGM_FI_DEV_* series"


class TraceError(GpunodeError):
    """A trace file that cannot be used: missing, wrong columns, or a bad value."""

    default_hint = (
        "point --trace-dir at a folder holding the openb CSVs (csv/openb_node_list_gpu_node.csv and "
        "csv/openb_pod_list_<name>.csv), as published with the FGD paper"
    )
