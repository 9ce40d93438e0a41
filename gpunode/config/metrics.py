"""The `gpunode.metrics` configuration section: where the endpoint listens and how often it collects.

Parsed strictly with SectionReader so that a typo or a bad value is a
ConfigError naming the key. This module only parses; it starts nothing and
reads no file or environment variable (config.py does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpunode.contract.reader import SectionReader
from gpunode.errors import ConfigError

DEFAULT_LISTEN = ":9400"
# dcgm-exporter collects every 30 s. We read the backend every 5 s instead: one
# pass over a DGX-class node costs a few milliseconds of NVML calls in a worker
# thread, and it keeps every served value younger than 5 s for any Prometheus
# scrape interval (15 s and 30 s are the usual ones), where a 30 s cycle would
# serve values up to 30 s old and could skip a short power or memory spike
# entirely. The interval is configurable down to 1 s and up to 10 minutes.
DEFAULT_INTERVAL_S = 5.0
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 600.0
DEFAULT_ATTRIBUTION_TTL_S = 5.0
HOSTNAME_LABELS = ("Hostname", "hostname")


@dataclass(frozen=True)
class ListenAddress:
    """A TCP listen address. host "" means every interface (IPv4 and IPv6)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class MetricsConfig:
    """Settings of the metrics endpoint and its background collector."""

    enabled: bool = True
    listen: str = DEFAULT_LISTEN
    interval_s: float = DEFAULT_INTERVAL_S
    hostname_label: str = "Hostname"  # "Hostname" (dcgm-exporter <= 4.8) or "hostname"
    hostname: str | None = None  # the label's value; None = the agent's node name
    pod_resources_socket: str | None = None  # None = the agent's gpunode.podResourcesSocket
    attribution_ttl_s: float = DEFAULT_ATTRIBUTION_TTL_S
    pod_labels: bool = True  # attach namespace/pod/container to devices a pod holds
    web_config_file: str | None = None  # exporter-toolkit web configuration; None: plain HTTP

    @property
    def listen_address(self) -> ListenAddress:
        """`listen` parsed into host and port; ConfigError if it is not HOST:PORT."""
        return parse_listen(self.listen, "listen")


def parse_listen(value: str, where: str) -> ListenAddress:
    """Parse ":9400", "0.0.0.0:9400", "127.0.0.1:0", "[::1]:9400" or "localhost:9400"."""
    m = re.fullmatch(
        r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.\-]*)):(?P<port>\d{1,5})", value.strip()
    )
    if not m or int(m.group("port")) > 65535:
        raise ConfigError(
            f"{where}: expected HOST:PORT such as :9400, 0.0.0.0:9400 or [::1]:9400, got {value!r}",
            hint="write the address as dcgm-exporter's --address flag takes it, e.g. :9400",
        )
    host = m.group("v6") if m.group("v6") is not None else m.group("host")
    return ListenAddress(host=host or "", port=int(m.group("port")))


def parse_metrics_config(data: object, where: str) -> MetricsConfig:
    """Validate the `gpunode.metrics` section (a mapping; missing or null means all defaults)."""
    r = SectionReader(data, where)
    interval_s = r.duration("interval", DEFAULT_INTERVAL_S)
    if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
        raise ConfigError(
            f"{r.key_path('interval')}: must be between {MIN_INTERVAL_S:g}s and {MAX_INTERVAL_S:g}s, "
            f"got {interval_s:g}s",
            hint="5s suits Prometheus scrape intervals of 15s to 60s",
        )
    ttl_s = r.duration("attributionTtl", DEFAULT_ATTRIBUTION_TTL_S)
    if ttl_s > 300:
        raise ConfigError(
            f"{r.key_path('attributionTtl')}: at most 300s, got {ttl_s:g}s",
            hint="a long TTL labels a new pod's GPU with the previous pod; keep it near the interval",
        )
    listen = r.get("listen", str, DEFAULT_LISTEN)
    parse_listen(listen, r.key_path("listen"))
    socket = r.get("podResourcesSocket", str, None)
    if socket is not None and not socket.startswith("/"):
        raise ConfigError(f"{r.key_path('podResourcesSocket')}: expected an absolute path, got {socket!r}")
    hostname = r.get("hostname", str, None)
    if hostname is not None and not hostname.strip():
        raise ConfigError(f"{r.key_path('hostname')}: must not be empty (leave it out to use the node name)")
    web_config_file = r.get("webConfigFile", str, None)
    if web_config_file is not None and not web_config_file.startswith("/"):
        raise ConfigError(
            f"{r.key_path('webConfigFile')}: expected an absolute path, got {web_config_file!r}",
            hint="name the exporter-toolkit web configuration file by its absolute path",
        )
    cfg = MetricsConfig(
        enabled=r.get("enabled", bool, True),
        listen=listen,
        interval_s=interval_s,
        hostname_label=r.choice("hostnameLabel", HOSTNAME_LABELS, "Hostname"),
        hostname=hostname,
        pod_resources_socket=socket,
        attribution_ttl_s=ttl_s,
        pod_labels=r.get("podLabels", bool, True),
        web_config_file=web_config_file,
    )
    r.finish()
    return cfg
