"""The chart's extender.prometheus values become the extender's flags, and the schema refuses bad ones."""

from __future__ import annotations

from typing import Any

import pytest

from gpunode.cluster.extender.cli import build_extender
from gpunode.cluster.extender.promfeed import PromFeed
from tests.deploy.test_helm_chart import FULLNAME, VALUE_SETS, extender_parser, needs_helm, render, run_helm


def extender_args(values: dict[str, Any]) -> list[str]:
    pod = render(values).named("Deployment", f"{FULLNAME}-extender")["spec"]["template"]["spec"]
    return list(pod["containers"][0]["args"])


@needs_helm
def test_prometheus_values_become_flags_the_extender_takes() -> None:
    args = extender_args(VALUE_SETS["extender-prometheus"])
    extender, _ = build_extender(extender_parser().parse_args(args))
    feed = extender.load_feed
    assert isinstance(feed, PromFeed)
    try:
        assert feed.url == "http://prometheus-operated.monitoring:9090" and feed.node_label == "hostname"
        assert (feed.refresh_s, feed.timeout_s, feed.max_age_s) == (15.0, 5.0, 60.0)
        assert (extender.config.energy_weight, extender.config.load_weight) == (1.0, 0.25)
    finally:
        feed.stop()
    assert not any(a.startswith("--prometheus") for a in extender_args(VALUE_SETS["extender-defaults"]))


@needs_helm
@pytest.mark.parametrize(
    "prometheus",
    [
        {"url": "prometheus:9090"},
        {"url": "http://p:9090/?q=up"},
        {"timeout": "0s"},
        {"refreshInterval": "soon"},
        {"nodeLabel": 'Hostname"} or vector(1) #'},
        {"energyWeight": -1},
        {"loadWeight": 1000},
        {"loadWeight": "0.5"},
        {"weight": 1},
    ],
)
def test_the_schema_refuses_bad_prometheus_values(prometheus: dict[str, Any]) -> None:
    proc = run_helm("template", "r", values={"extender": {"enabled": True, "prometheus": prometheus}})
    assert proc.returncode != 0 and "prometheus" in proc.stderr, proc.stderr
