"""The gpunode.metrics configuration section."""

from __future__ import annotations

import pytest

from gpunode.config.metrics import ListenAddress, MetricsConfig, parse_listen, parse_metrics_config
from gpunode.errors import ConfigError

WHERE = "cfg.yaml: gpunode.metrics"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(None, MetricsConfig(), id="missing-section-gives-defaults"),
        pytest.param({}, MetricsConfig(), id="empty-section-gives-defaults"),
        pytest.param(
            {
                "listen": "127.0.0.1:9500",
                "interval": "10s",
                "hostnameLabel": "hostname",
                "hostname": "gpu-node-7",
                "podResourcesSocket": "/run/kubelet/pod-resources.sock",
                "attributionTtl": "2500ms",
                "podLabels": False,
                "enabled": False,
            },
            MetricsConfig(
                enabled=False,
                listen="127.0.0.1:9500",
                interval_s=10.0,
                hostname_label="hostname",
                hostname="gpu-node-7",
                pod_resources_socket="/run/kubelet/pod-resources.sock",
                attribution_ttl_s=2.5,
                pod_labels=False,
            ),
            id="every-key",
        ),
        pytest.param({"interval": 1}, MetricsConfig(interval_s=1.0), id="interval-as-number"),
    ],
)
def test_parse_accepts(data: object, expected: MetricsConfig) -> None:
    assert parse_metrics_config(data, WHERE) == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({"intervall": "5s"}, "unknown key", id="typo-is-refused"),
        pytest.param({"interval": "0.5s"}, "between 1s and 600s", id="interval-too-short"),
        pytest.param({"interval": "1h"}, "between 1s and 600s", id="interval-too-long"),
        pytest.param({"interval": "soon"}, "expected a duration", id="interval-not-a-duration"),
        pytest.param(
            {"hostnameLabel": "HOSTNAME"}, "expected one of Hostname, hostname", id="bad-hostname-label"
        ),
        pytest.param({"listen": "9400"}, "expected HOST:PORT", id="listen-without-colon"),
        pytest.param({"listen": ":99999"}, "expected HOST:PORT", id="listen-port-out-of-range"),
        pytest.param({"podResourcesSocket": "kubelet.sock"}, "absolute path", id="relative-socket"),
        pytest.param({"attributionTtl": "10m"}, "at most 300s", id="ttl-too-long"),
        pytest.param({"hostname": "  "}, "must not be empty", id="blank-hostname"),
        pytest.param({"podLabels": "yes"}, "expected bool", id="pod-labels-not-bool"),
        pytest.param(["listen"], "expected a mapping", id="not-a-mapping"),
    ],
)
def test_parse_refuses(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_metrics_config(data, WHERE)
    assert message in str(info.value)
    assert str(info.value).startswith(WHERE)
    assert info.value.hint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(":9400", ListenAddress("", 9400), id="all-interfaces"),
        pytest.param("0.0.0.0:9400", ListenAddress("0.0.0.0", 9400), id="ipv4-any"),
        pytest.param("127.0.0.1:0", ListenAddress("127.0.0.1", 0), id="ephemeral-port"),
        pytest.param("[::1]:9400", ListenAddress("::1", 9400), id="ipv6-loopback"),
        pytest.param("localhost:9400", ListenAddress("localhost", 9400), id="hostname"),
    ],
)
def test_parse_listen(text: str, expected: ListenAddress) -> None:
    assert parse_listen(text, "listen") == expected


def test_listen_address_prints_back() -> None:
    assert str(parse_listen("[::1]:9400", "x")) == "[::1]:9400"
    assert str(parse_listen(":9400", "x")) == ":9400"


def test_the_whole_config_file_reaches_the_section() -> None:
    from gpunode.config.agent import parse_config

    cfg = parse_config({"version": "v1", "gpunode": {"metrics": {"interval": "7s"}}}, "cfg.yaml")
    assert cfg.metrics == MetricsConfig(interval_s=7.0)
    with pytest.raises(ConfigError, match="interval"):
        parse_config({"version": "v1", "gpunode": {"metrics": {"interval": "0s"}}}, "cfg.yaml")
