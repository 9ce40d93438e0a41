"""The `gpunode.health` and `gpunode.remediation` configuration sections: frozen settings and strict parsers.

The defaults are meant for production (docs/health.md explains each key);
tests pass short windows. Parsing goes through gpunode.config.reader.SectionReader
so that a typo or a wrong type names the file and the key. This module only
parses: it starts nothing and reads no file or environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpunode.contract.reader import SectionReader
from gpunode.contract.xids import (
    COUNTED,
    DEFAULT_FATAL,
    DEFAULT_IGNORED,
    DEFAULT_INSTANCE_FATAL,
    FATAL,
    IGNORED,
    INSTANCE_FATAL,
)
from gpunode.errors import ConfigError

REMEDIATION_MODES = ("kubernetes", "baremetal", "off")


@dataclass(frozen=True)
class XidPolicy:
    """How each XID code is judged; a code in no list is counted."""

    ignored: frozenset[int] = frozenset(DEFAULT_IGNORED)
    fatal: frozenset[int] = frozenset(DEFAULT_FATAL)  # the whole GPU, at once
    instance_fatal: frozenset[int] = frozenset(DEFAULT_INSTANCE_FATAL)  # the MIG instance reported, at once
    count_threshold: int = 3  # counted XIDs on one device within count_window_s that mark it; 0 = never
    count_window_s: float = 600.0

    def classify(self, code: int) -> str:
        """The verdict for XID `code`: "ignored", "fatal", "instance-fatal" or, in no list, "counted"."""
        if code in self.ignored:
            return IGNORED
        if code in self.fatal:
            return FATAL
        if code in self.instance_fatal:
            return INSTANCE_FATAL
        return COUNTED


@dataclass(frozen=True)
class HealthConfig:
    """Settings of the `gpunode.health` section: probing, recovery window, XID and ECC rules (times in s)."""

    enabled: bool = True
    probe_interval_s: float = 10.0
    probe_timeout_s: float = 5.0  # a probe (an NVML call) that takes longer counts as a failure
    recovery_window_s: float = 300.0  # probes must pass this long after the last fault
    xid: XidPolicy = field(default_factory=XidPolicy)
    dbe_fatal: bool = True
    sbe_threshold: int = 100  # corrected errors within sbe_window_s that mark a GPU; 0 = never
    sbe_window_s: float = 3600.0
    pending_repair_unhealthy: bool = True  # row remap pending / retired pages pending mark the GPU


@dataclass(frozen=True)
class BareMetalConfig:
    """How baremetal remediation stops the processes on a faulty GPU: signals, or a hook command (seconds)."""

    term_grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long
    hook: tuple[str, ...] | None = None  # run this command instead of signalling the processes
    hook_timeout_s: float = 60.0


@dataclass(frozen=True)
class RemediationConfig:
    """Settings of the `gpunode.remediation` section: mode, eviction pacing and retries, node marking."""

    mode: str = "kubernetes"  # kubernetes | baremetal | off
    dry_run: bool = False
    kubeconfig: str | None = None  # None: the in-cluster service account, else ~/.kube/config
    request_timeout_s: float = 10.0
    eviction_deadline_s: float = 600.0  # keep retrying a blocked (PDB) or failing eviction this long
    delete_after_deadline: bool = False  # then delete the pod (bypassing its PodDisruptionBudget)
    pod_grace_period_s: int | None = None  # None: the pod's own terminationGracePeriodSeconds
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    max_evictions: int = 10  # evictions started per eviction_interval_s, node-wide
    eviction_interval_s: float = 60.0
    mark_node: bool = True  # annotate the node with its unhealthy GPUs
    post_events: bool = True
    baremetal: BareMetalConfig = field(default_factory=BareMetalConfig)


def _positive(r: SectionReader, key: str, value: float) -> float:
    if value <= 0:
        raise ConfigError(f"{r.key_path(key)}: must be greater than zero, got {value:g}")
    return value


def _non_negative_int(r: SectionReader, key: str, default: int) -> int:
    value = r.get(key, int, default)
    if value < 0:
        raise ConfigError(f"{r.key_path(key)}: cannot be negative, got {value}")
    return value


def _codes(r: SectionReader, key: str, default: tuple[int, ...]) -> frozenset[int]:
    codes = r.int_list(key, default)
    bad = [c for c in codes if c <= 0]
    if bad:
        raise ConfigError(f"{r.key_path(key)}: XID codes are positive integers, got {bad}")
    return frozenset(codes)


def parse_xid_policy(r: SectionReader) -> XidPolicy:
    """Parse the `xid` section; ConfigError when a code is not positive or is in two lists."""
    ignored = _codes(r, "ignored", DEFAULT_IGNORED)
    fatal = _codes(r, "fatal", DEFAULT_FATAL)
    instance = _codes(r, "instanceFatal", DEFAULT_INSTANCE_FATAL)
    for a, b, sa, sb in (
        ("ignored", "fatal", ignored, fatal),
        ("ignored", "instanceFatal", ignored, instance),
        ("fatal", "instanceFatal", fatal, instance),
    ):
        both = sorted(sa & sb)
        if both:
            raise ConfigError(
                f"{r.key_path(a)} and {r.key_path(b)} both list XID {', '.join(map(str, both))}",
                hint="a code belongs to one list; remove it from the other",
            )
    policy = XidPolicy(
        ignored=ignored,
        fatal=fatal,
        instance_fatal=instance,
        count_threshold=_non_negative_int(r, "countThreshold", 3),
        count_window_s=_positive(r, "countWindow", r.duration("countWindow", 600.0)),
    )
    r.finish()
    return policy


def parse_health_config(data: object, where: str) -> HealthConfig:
    """Parse the `gpunode.health` section (an absent section gives the defaults)."""
    r = SectionReader(data, where)
    ecc = r.section("ecc")
    cfg = HealthConfig(
        enabled=r.get("enabled", bool, True),
        probe_interval_s=_positive(r, "probeInterval", r.duration("probeInterval", 10.0)),
        probe_timeout_s=_positive(r, "probeTimeout", r.duration("probeTimeout", 5.0)),
        recovery_window_s=r.duration("recoveryWindow", 300.0),
        xid=parse_xid_policy(r.section("xid")),
        dbe_fatal=ecc.get("doubleBitFatal", bool, True),
        sbe_threshold=_non_negative_int(ecc, "singleBitThreshold", 100),
        sbe_window_s=_positive(ecc, "singleBitWindow", ecc.duration("singleBitWindow", 3600.0)),
        pending_repair_unhealthy=r.get("pendingRepairUnhealthy", bool, True),
    )
    ecc.finish()
    r.finish()
    return cfg


def _parse_hook(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ConfigError(
            f"{where}: expected the command as a list of arguments, got the string {value!r}",
            hint='write it as a list, e.g. ["/usr/local/bin/drain-gpu", "--reason", "gpu-fault"]',
        )
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a non-empty list of strings, got {value!r}")
    return tuple(value)


def parse_remediation_config(data: object, where: str) -> RemediationConfig:
    """Parse the `gpunode.remediation` section (an absent section gives the defaults)."""
    r = SectionReader(data, where)
    bm = r.section("baremetal")
    baremetal = BareMetalConfig(
        term_grace_s=bm.duration("termGracePeriod", 10.0),
        hook=bm.parse("hook", _parse_hook, None),
        hook_timeout_s=_positive(bm, "hookTimeout", bm.duration("hookTimeout", 60.0)),
    )
    bm.finish()
    grace_s = r.duration("podGracePeriod", None)
    grace = None if grace_s is None else round(grace_s)
    retry_initial = _positive(r, "retryInitial", r.duration("retryInitial", 1.0))
    retry_max = _positive(r, "retryMax", r.duration("retryMax", 60.0))
    if retry_max < retry_initial:
        raise ConfigError(
            f"{r.key_path('retryMax')}: must not be shorter than retryInitial ({retry_initial:g} s), "
            f"got {retry_max:g} s"
        )
    max_evictions = r.get("maxEvictions", int, 10)
    if max_evictions < 1:
        raise ConfigError(f"{r.key_path('maxEvictions')}: must be at least 1, got {max_evictions}")
    cfg = RemediationConfig(
        mode=r.choice("mode", REMEDIATION_MODES, "kubernetes"),
        dry_run=r.get("dryRun", bool, False),
        kubeconfig=r.get("kubeconfig", str, None),
        request_timeout_s=_positive(r, "requestTimeout", r.duration("requestTimeout", 10.0)),
        eviction_deadline_s=r.duration("evictionDeadline", 600.0),
        delete_after_deadline=r.get("deleteAfterDeadline", bool, False),
        pod_grace_period_s=grace,
        retry_initial_s=retry_initial,
        retry_max_s=retry_max,
        max_evictions=max_evictions,
        eviction_interval_s=_positive(r, "evictionInterval", r.duration("evictionInterval", 60.0)),
        mark_node=r.get("markNode", bool, True),
        post_events=r.get("postEvents", bool, True),
        baremetal=baremetal,
    )
    r.finish()
    return cfg
