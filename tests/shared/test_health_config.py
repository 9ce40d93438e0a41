"""The gpunode.health and gpunode.remediation sections: defaults, every key, and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpunode.config.agent import parse_config
from gpunode.config.health import (
    HealthConfig,
    RemediationConfig,
    XidPolicy,
    parse_health_config,
    parse_remediation_config,
)
from gpunode.contract.xids import COUNTED, FATAL, IGNORED, INSTANCE_FATAL, XID_TABLE, describe_xid
from gpunode.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "health.md"


def test_absent_sections_give_the_production_defaults() -> None:
    cfg = parse_config({}, "f.yaml")
    assert cfg.health == HealthConfig()
    assert cfg.remediation == RemediationConfig()
    h = HealthConfig()
    assert (h.probe_interval_s, h.probe_timeout_s, h.recovery_window_s) == (10.0, 5.0, 300.0)
    assert (h.sbe_threshold, h.sbe_window_s, h.dbe_fatal) == (100, 3600.0, True)


@pytest.mark.parametrize(
    ("code", "policy"),
    [
        pytest.param(13, IGNORED, id="13-app-exception"),
        pytest.param(31, IGNORED, id="31-page-fault"),
        pytest.param(43, IGNORED, id="43-app-stopped"),
        pytest.param(45, IGNORED, id="45-cleanup"),
        pytest.param(68, IGNORED, id="68-nvdec"),
        pytest.param(109, FATAL, id="109-ctxsw-timeout-needs-reset"),
        pytest.param(48, FATAL, id="48-dbe"),
        pytest.param(64, FATAL, id="64-remap-failure"),
        pytest.param(74, FATAL, id="74-nvlink"),
        pytest.param(79, FATAL, id="79-off-the-bus"),
        pytest.param(95, FATAL, id="95-uncontained"),
        pytest.param(119, FATAL, id="119-gsp-timeout"),
        pytest.param(120, FATAL, id="120-gsp-error"),
        pytest.param(94, INSTANCE_FATAL, id="94-contained"),
        pytest.param(63, COUNTED, id="63-remap-event"),
        pytest.param(92, COUNTED, id="92-sbe-rate"),
        pytest.param(12345, COUNTED, id="unknown-code"),
    ],
)
def test_default_xid_policy(code: int, policy: str) -> None:
    assert XidPolicy().classify(code) == policy


def test_every_key_is_read() -> None:
    cfg = parse_config(
        {
            "gpunode": {
                "health": {
                    "enabled": False,
                    "probeInterval": "500ms",
                    "probeTimeout": "2s",
                    "recoveryWindow": "1m",
                    "pendingRepairUnhealthy": False,
                    "xid": {
                        "ignored": [13, 31],
                        "fatal": [79],
                        "instanceFatal": [94, 43],
                        "countThreshold": 5,
                        "countWindow": "1h",
                    },
                    "ecc": {"doubleBitFatal": False, "singleBitThreshold": 7, "singleBitWindow": "10m"},
                },
                "remediation": {
                    "mode": "baremetal",
                    "dryRun": True,
                    "kubeconfig": "/etc/kube.conf",
                    "requestTimeout": "3s",
                    "evictionDeadline": "2m",
                    "deleteAfterDeadline": True,
                    "podGracePeriod": "30s",
                    "retryInitial": "200ms",
                    "retryMax": "5s",
                    "maxEvictions": 2,
                    "evictionInterval": "10s",
                    "markNode": False,
                    "postEvents": False,
                    "baremetal": {
                        "termGracePeriod": "3s",
                        "hook": ["/bin/drain", "--now"],
                        "hookTimeout": "20s",
                    },
                },
            }
        },
        "f.yaml",
    )
    h: HealthConfig = cfg.health
    assert h == HealthConfig(
        enabled=False,
        probe_interval_s=0.5,
        probe_timeout_s=2.0,
        recovery_window_s=60.0,
        xid=XidPolicy(frozenset({13, 31}), frozenset({79}), frozenset({94, 43}), 5, 3600.0),
        dbe_fatal=False,
        sbe_threshold=7,
        sbe_window_s=600.0,
        pending_repair_unhealthy=False,
    )
    r: RemediationConfig = cfg.remediation
    assert (r.mode, r.dry_run, r.kubeconfig, r.request_timeout_s) == (
        "baremetal",
        True,
        "/etc/kube.conf",
        3.0,
    )
    assert (r.eviction_deadline_s, r.delete_after_deadline, r.pod_grace_period_s) == (120.0, True, 30)
    assert (r.retry_initial_s, r.retry_max_s, r.max_evictions, r.eviction_interval_s) == (0.2, 5.0, 2, 10.0)
    assert (r.mark_node, r.post_events) == (False, False)
    assert (r.baremetal.term_grace_s, r.baremetal.hook, r.baremetal.hook_timeout_s) == (
        3.0,
        ("/bin/drain", "--now"),
        20.0,
    )


HEALTH_ERRORS = {
    "unknown-key": ({"probeIntervall": 5}, r"unknown key probeIntervall \(did you mean probeInterval\?\)"),
    "unknown-xid-key": ({"xid": {"fatals": [79]}}, r"xid: unknown key fatals"),
    "code-in-two-lists": ({"xid": {"ignored": [13, 79]}}, r"xid\.ignored and .*xid\.fatal both list XID 79"),
    "negative-code": ({"xid": {"fatal": [-1]}}, r"positive integers"),
    "codes-not-a-list": ({"xid": {"fatal": "79"}}, r"expected a list of integers"),
    "zero-interval": ({"probeInterval": 0}, r"probeInterval: must be greater than zero"),
    "bad-duration": ({"recoveryWindow": "soon"}, r"recoveryWindow: expected a duration"),
    "negative-threshold": ({"ecc": {"singleBitThreshold": -1}}, r"singleBitThreshold: cannot be negative"),
    "wrong-type": ({"enabled": "yes"}, r"enabled: expected bool"),
}


@pytest.mark.parametrize(("section", "message"), HEALTH_ERRORS.values(), ids=HEALTH_ERRORS.keys())
def test_health_errors_name_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_health_config(section, "f.yaml: gpunode.health")
    assert re.search(message, str(err.value)), str(err.value)
    assert str(err.value).startswith("f.yaml: gpunode.health")


REMEDIATION_ERRORS = {
    "unknown-mode": ({"mode": "slurm"}, r"mode: expected one of kubernetes, baremetal, off"),
    "hook-as-a-string": ({"baremetal": {"hook": "drain --now"}}, r"hook: expected the command as a list"),
    "empty-hook": ({"baremetal": {"hook": []}}, r"hook: expected a non-empty list of strings"),
    "zero-evictions": ({"maxEvictions": 0}, r"maxEvictions: must be at least 1"),
    "retry-max-below-initial": ({"retryInitial": "10s", "retryMax": "1s"}, r"retryMax: must not be shorter"),
    "unknown-baremetal-key": ({"baremetal": {"grace": 1}}, r"baremetal: unknown key grace"),
}


@pytest.mark.parametrize(("section", "message"), REMEDIATION_ERRORS.values(), ids=REMEDIATION_ERRORS.keys())
def test_remediation_errors_name_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_remediation_config(section, "f.yaml: gpunode.remediation")
    assert re.search(message, str(err.value)), str(err.value)


def test_describe_xid() -> None:
    assert describe_xid(79) == "XID 79 (GPU has fallen off the bus)"
    assert describe_xid(4242) == "XID 4242"


def test_docs_table_matches_the_default_policy() -> None:
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \| ([a-z-]+) \|", DOCS.read_text(), re.MULTILINE)
    documented = {int(code): policy.strip() for code, _, policy in rows}
    assert documented == {code: info.policy for code, info in XID_TABLE.items()}


def test_docs_name_every_config_key() -> None:
    text = DOCS.read_text()
    keys = [
        "enabled", "probeInterval", "probeTimeout", "recoveryWindow", "pendingRepairUnhealthy",
        "ignored", "fatal", "instanceFatal", "countThreshold", "countWindow",
        "doubleBitFatal", "singleBitThreshold", "singleBitWindow",
        "mode", "dryRun", "kubeconfig", "requestTimeout", "evictionDeadline", "deleteAfterDeadline",
        "podGracePeriod", "retryInitial", "retryMax", "maxEvictions", "evictionInterval", "markNode",
        "postEvents", "termGracePeriod", "hook", "hookTimeout",
    ]  # fmt: skip
    missing = [k for k in keys if not re.search(rf"`(\w+\.)?{k}`", text)]
    assert missing == []


# -- bounds: every count, duration and list, one key at a time -------------------------------------

HEALTH_BOUNDS = {
    "probe-interval-low": ({"probeInterval": "5ms"}, "probeInterval: expected 0.01s..1h, got 0.005s"),
    "probe-interval-high": ({"probeInterval": "2h"}, "probeInterval: expected 0.01s..1h, got 2h"),
    "probe-timeout-high": ({"probeTimeout": "6m"}, "probeTimeout: expected 0.01s..5m, got 6m"),
    "probe-timeout-zero": ({"probeTimeout": 0}, "probeTimeout: must be greater than zero (0.01s..5m), got 0"),
    "recovery-window": ({"recoveryWindow": "25h"}, "recoveryWindow: expected 0..1d, got 25h"),
    "count-threshold": ({"xid": {"countThreshold": 10**18}}, "xid.countThreshold: expected 0..10000, got 10"),
    "count-window": ({"xid": {"countWindow": "48h"}}, "xid.countWindow: expected 0.1s..1d, got 2d"),
    "xid-code-large": (
        {"xid": {"fatal": [79, 2**63]}},
        "xid.fatal: XID codes are positive integers up to 999",
    ),
    "xid-list-long": (
        {"xid": {"ignored": list(range(1, 300))}},
        "xid.ignored: at most 256 XID codes, got 299",
    ),
    "sbe-threshold": ({"ecc": {"singleBitThreshold": 2_000_000}}, "singleBitThreshold: expected 0..1000000"),
    "sbe-window": ({"ecc": {"singleBitWindow": "192h"}}, "a duration must be at most 7d"),
    "sbe-window-low": ({"ecc": {"singleBitWindow": "10ms"}}, "singleBitWindow: expected 0.1s..7d, got 0.01s"),
}


@pytest.mark.parametrize(("section", "fragment"), HEALTH_BOUNDS.values(), ids=HEALTH_BOUNDS.keys())
def test_health_bounds_are_one_line_naming_the_key_and_the_range(
    section: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"gpunode": {"health": section}}, "f.yaml")
    message = str(err.value)
    assert message.startswith("f.yaml: gpunode.health.") and fragment in message, message
    assert "\n" not in message and len(message) < 200 and err.value.hint != ConfigError.default_hint


REMEDIATION_BOUNDS = {
    "request-timeout": ({"requestTimeout": "10m"}, "requestTimeout: expected 0.1s..5m, got 10m"),
    "eviction-deadline": ({"evictionDeadline": "48h"}, "evictionDeadline: expected 0..1d, got 2d"),
    "pod-grace": ({"podGracePeriod": "72h"}, "podGracePeriod: expected 0..1d, got 3d"),
    "retry-initial": ({"retryInitial": "1ms"}, "retryInitial: expected 0.01s..5m, got 0.001s"),
    "retry-max": ({"retryMax": "2h"}, "retryMax: expected 0.01s..1h, got 2h"),
    "max-evictions": ({"maxEvictions": 9223372036854775808}, "maxEvictions: expected 1..1000000, got 9223"),
    "eviction-interval": ({"evictionInterval": "500ms"}, "evictionInterval: expected 1s..1d, got 0.5s"),
    "term-grace": ({"baremetal": {"termGracePeriod": "2h"}}, "termGracePeriod: expected 0..1h, got 2h"),
    "hook-timeout": ({"baremetal": {"hookTimeout": "0s"}}, "hookTimeout: must be greater than zero"),
    "hook-args": ({"baremetal": {"hook": ["x"] * 65}}, "hook: expected 1..64 arguments of at most 4096"),
    "hook-arg-long": ({"baremetal": {"hook": ["/bin/x", "a" * 5000]}}, "up to 5000 characters"),
    "kubeconfig": ({"kubeconfig": "/" + "k" * 5000}, "kubeconfig: expected a path of 1..4096 characters"),
}


@pytest.mark.parametrize(("section", "fragment"), REMEDIATION_BOUNDS.values(), ids=REMEDIATION_BOUNDS.keys())
def test_remediation_bounds_are_one_line_naming_the_key_and_the_range(
    section: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"gpunode": {"remediation": section}}, "f.yaml")
    message = str(err.value)
    assert message.startswith("f.yaml: gpunode.remediation.") and fragment in message, message
    assert "\n" not in message and len(message) < 200 and err.value.hint


def test_the_edges_of_the_health_ranges_are_accepted() -> None:
    cfg = parse_config(
        {
            "gpunode": {
                "health": {
                    "probeInterval": "10ms",
                    "probeTimeout": "5m",
                    "recoveryWindow": 0,
                    "xid": {"countThreshold": 10_000, "countWindow": "24h", "fatal": [999], "ignored": []},
                    "ecc": {"singleBitThreshold": 0, "singleBitWindow": "168h"},
                },
                "remediation": {
                    "podGracePeriod": 0,
                    "maxEvictions": 1_000_000,
                    "evictionInterval": "1s",
                    "retryInitial": "10ms",
                    "retryMax": "1h",
                    "baremetal": {"termGracePeriod": 0, "hookTimeout": "1h", "hook": ["a"] * 64},
                },
            }
        },
        "f.yaml",
    )
    h, r = cfg.health, cfg.remediation
    assert (h.probe_interval_s, h.probe_timeout_s, h.recovery_window_s) == (0.01, 300.0, 0.0)
    assert (h.xid.count_threshold, h.xid.count_window_s, h.xid.fatal) == (10_000, 86400.0, frozenset({999}))
    assert (h.sbe_threshold, h.sbe_window_s) == (0, 7 * 86400.0)
    assert (r.pod_grace_period_s, r.max_evictions, r.eviction_interval_s) == (0, 1_000_000, 1.0)
    assert (r.retry_initial_s, r.retry_max_s, r.baremetal.term_grace_s, r.baremetal.hook_timeout_s) == (
        0.01,
        3600.0,
        0.0,
        3600.0,
    )
    assert r.baremetal.hook is not None and len(r.baremetal.hook) == 64
