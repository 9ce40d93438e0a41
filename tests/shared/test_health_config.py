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
