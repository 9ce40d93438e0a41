"""The `gpunode.health` and `gpunode.remediation` configuration sections: frozen settings and strict parsers.

The defaults are meant for production (docs/health.md explains each key);
tests pass short windows. Parsing goes through gpunode.config.reader.SectionReader
so that a typo or a wrong type names the file and the key. This module only
parses: it starts nothing and reads no file or environment variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpunode.contract.reader import SectionReader, excerpt, format_seconds
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

# Bounds on every count, duration and list (docs/health.md, Configuration): (lowest, highest), seconds
# for durations. Far beyond any sensible setting, and low enough that no timer, counter or list built
# from them runs away. The lower bounds leave room for the short windows tests and benchmarks use.
PROBE_INTERVAL_S = (0.01, 3600.0)
PROBE_TIMEOUT_S = (0.01, 300.0)
RECOVERY_WINDOW_S = (0.0, 86400.0)
XID_COUNT_THRESHOLD = (0, 10_000)
XID_COUNT_WINDOW_S = (0.1, 86400.0)
MAX_XID_CODE = 999  # NVIDIA's XID catalog stops well below this
MAX_XID_CODES = 256  # entries in each of xid.ignored, xid.fatal, xid.instanceFatal
SBE_THRESHOLD = (0, 1_000_000)
SBE_WINDOW_S = (0.1, 7 * 86400.0)
REQUEST_TIMEOUT_S = (0.1, 300.0)
EVICTION_DEADLINE_S = (0.0, 86400.0)
POD_GRACE_PERIOD_S = (0.0, 86400.0)
RETRY_INITIAL_S = (0.01, 300.0)
RETRY_MAX_S = (0.01, 3600.0)
MAX_EVICTIONS = (1, 1_000_000)
EVICTION_INTERVAL_S = (1.0, 86400.0)
TERM_GRACE_S = (0.0, 3600.0)
HOOK_TIMEOUT_S = (0.1, 3600.0)
MAX_HOOK_ARGS = 64
MAX_TEXT_CHARS = 4096  # kubeconfig and each hook argument (PATH_MAX)


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


def _seconds(value: float) -> str:
    return format_seconds(value) if value else "0"


def _duration(r: SectionReader, key: str, default: float | None, bounds: tuple[float, float]) -> float:
    """A duration within bounds (default None: the caller has seen the key); one line naming the key and
    the range otherwise."""
    low, high = bounds
    allowed = f"{_seconds(low)}..{_seconds(high)}"
    hint = f"set {key} within {allowed}" + ("" if default is None else f" (default {_seconds(default)})")
    try:
        value = r.duration(key, 0.0 if default is None else default)  # None: the caller saw the key
    except ConfigError as exc:  # not a duration, or beyond any duration's ceiling
        raise ConfigError(f"{exc} (allowed {allowed})", hint=hint) from None
    if not low <= value <= high:
        problem = f"must be greater than zero ({allowed})" if value <= 0 else f"expected {allowed}"
        raise r.fail(key, f"{problem}, got {_seconds(value)}", hint=hint)
    return value


def _count(r: SectionReader, key: str, default: int, bounds: tuple[int, int]) -> int:
    """An integer within bounds; one line naming the key and the range otherwise."""
    low, high = bounds
    value = r.get(key, int, default)
    if not low <= value <= high:
        if value < 0:
            problem = f"cannot be negative ({low}..{high})"
        elif value < low:
            problem = f"must be at least {low} ({low}..{high})"
        else:
            problem = f"expected {low}..{high}"
        raise r.fail(
            key, f"{problem}, got {value!s:.40}", hint=f"set {key} within {low}..{high} (default {default})"
        )
    return value


def _codes(r: SectionReader, key: str, default: tuple[int, ...]) -> frozenset[int]:
    codes = r.int_list(key, default)
    if len(codes) > MAX_XID_CODES:
        raise r.fail(
            key,
            f"at most {MAX_XID_CODES} XID codes, got {len(codes)}",
            hint="list each code once; codes in no list are counted",
        )
    bad = [c for c in codes if not 0 < c <= MAX_XID_CODE]
    if bad:
        raise r.fail(
            key,
            f"XID codes are positive integers up to {MAX_XID_CODE} (1..{MAX_XID_CODE}), got {bad[0]!s:.40}",
            hint="copy the codes from the XID table in docs/health.md or NVIDIA's XID catalog",
        )
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
        count_threshold=_count(r, "countThreshold", 3, XID_COUNT_THRESHOLD),
        count_window_s=_duration(r, "countWindow", 600.0, XID_COUNT_WINDOW_S),
    )
    r.finish()
    return policy


def parse_health_config(data: object, where: str) -> HealthConfig:
    """Parse the `gpunode.health` section (an absent section gives the defaults)."""
    r = SectionReader(data, where)
    ecc = r.section("ecc")
    cfg = HealthConfig(
        enabled=r.get("enabled", bool, True),
        probe_interval_s=_duration(r, "probeInterval", 10.0, PROBE_INTERVAL_S),
        probe_timeout_s=_duration(r, "probeTimeout", 5.0, PROBE_TIMEOUT_S),
        recovery_window_s=_duration(r, "recoveryWindow", 300.0, RECOVERY_WINDOW_S),
        xid=parse_xid_policy(r.section("xid")),
        dbe_fatal=ecc.get("doubleBitFatal", bool, True),
        sbe_threshold=_count(ecc, "singleBitThreshold", 100, SBE_THRESHOLD),
        sbe_window_s=_duration(ecc, "singleBitWindow", 3600.0, SBE_WINDOW_S),
        pending_repair_unhealthy=r.get("pendingRepairUnhealthy", bool, True),
    )
    ecc.finish()
    r.finish()
    return cfg


def _parse_hook(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ConfigError(
            f"{where}: expected the command as a list of arguments, got the string {excerpt(value)}",
            hint='write it as a list, e.g. ["/usr/local/bin/drain-gpu", "--reason", "gpu-fault"]',
        )
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where}: expected a non-empty list of strings, got {excerpt(value)}")
    if len(value) > MAX_HOOK_ARGS or any(len(v) > MAX_TEXT_CHARS or "\0" in v for v in value):
        raise ConfigError(
            f"{where}: expected 1..{MAX_HOOK_ARGS} arguments of at most {MAX_TEXT_CHARS} characters without "
            f"NUL bytes, got {len(value)} argument(s) of up to {max(map(len, value))} characters",
            hint="a hook is a program and a few arguments; pass anything long in a file",
        )
    return tuple(value)


def _kubeconfig(r: SectionReader) -> str | None:
    path = r.get("kubeconfig", str, None)
    if path is not None and (not path or len(path) > MAX_TEXT_CHARS or "\0" in path):
        raise r.fail(
            "kubeconfig",
            f"expected a path of 1..{MAX_TEXT_CHARS} characters without NUL bytes, got {len(path)} characters",
            hint="name the kubeconfig file, or leave the key out to use the in-cluster service account",
        )
    return path


def parse_remediation_config(data: object, where: str) -> RemediationConfig:
    """Parse the `gpunode.remediation` section (an absent section gives the defaults)."""
    r = SectionReader(data, where)
    bm = r.section("baremetal")
    baremetal = BareMetalConfig(
        term_grace_s=_duration(bm, "termGracePeriod", 10.0, TERM_GRACE_S),
        hook=bm.parse("hook", _parse_hook, None),
        hook_timeout_s=_duration(bm, "hookTimeout", 60.0, HOOK_TIMEOUT_S),
    )
    bm.finish()
    has_grace = r.raw("podGracePeriod", None) is not None  # absent: the pod's own grace period
    grace = round(_duration(r, "podGracePeriod", None, POD_GRACE_PERIOD_S)) if has_grace else None
    retry_initial = _duration(r, "retryInitial", 1.0, RETRY_INITIAL_S)
    retry_max = _duration(r, "retryMax", 60.0, RETRY_MAX_S)
    if retry_max < retry_initial:
        raise ConfigError(
            f"{r.key_path('retryMax')}: must not be shorter than retryInitial ({retry_initial:g} s), "
            f"got {retry_max:g} s"
        )
    max_evictions = _count(r, "maxEvictions", 10, MAX_EVICTIONS)
    cfg = RemediationConfig(
        mode=r.choice("mode", REMEDIATION_MODES, "kubernetes"),
        dry_run=r.get("dryRun", bool, False),
        kubeconfig=_kubeconfig(r),
        request_timeout_s=_duration(r, "requestTimeout", 10.0, REQUEST_TIMEOUT_S),
        eviction_deadline_s=_duration(r, "evictionDeadline", 600.0, EVICTION_DEADLINE_S),
        delete_after_deadline=r.get("deleteAfterDeadline", bool, False),
        pod_grace_period_s=grace,
        retry_initial_s=retry_initial,
        retry_max_s=retry_max,
        max_evictions=max_evictions,
        eviction_interval_s=_duration(r, "evictionInterval", 60.0, EVICTION_INTERVAL_S),
        mark_node=r.get("markNode", bool, True),
        post_events=r.get("postEvents", bool, True),
        baremetal=baremetal,
    )
    r.finish()
    return cfg
