"""Per-node power, utilisation and memory figures read from Prometheus, for the energy and load terms.

The agents export DCGM-style series (gpunode.contract.names: DCGM_FI_DEV_POWER_USAGE,
DCGM_FI_DEV_GPU_UTIL, DCGM_FI_DEV_FB_USED and _FB_FREE, each labelled with the node's
name, `Hostname` by default). PromFeed asks Prometheus's HTTP API (GET /api/v1/query,
instant queries) for one figure per node, aggregated by Prometheus so that an answer
stays small at thousands of nodes (MIG instances' series are left out; their GPU's own
series count):

- power: the mean draw of the node's GPUs, in W;
- util: the mean utilisation of the node's GPUs that report one, as a ratio 0..1;
- memory: framebuffer used / (used + free) over the node's GPUs, a ratio 0..1.

A background thread refreshes the figures every `refresh_s`; filter and prioritize only
read the last good set (figures()), never waiting on Prometheus. A set older than
`max_age_s` counts as stale and figures() returns None: prioritize then scores with the
placement policy alone and counts the answer in gpunode_extender_load_fallback_total.
One warning line is logged when Prometheus stops answering usefully (and one info line
when it answers again), never one per request.

Prometheus's answer is untrusted input: each request is bounded in time (`timeout_s`,
checked between chunks as well, so a server that trickles bytes is cut off) and in size
(MAX_RESPONSE_BYTES); an answer that is not a vector result of the expected shape fails
the whole refresh (MetricsFeedError), and a sample whose node name or value is unusable
(not a finite number, outside the figure's range, a duplicate node) is skipped and
counted in gpunode_extender_prometheus_rejected_samples_total. Figures for nodes the
extender does not know are kept but never read.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx2
import numpy as np
import numpy.typing as npt
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from gpunode.contract.names import (
    FB_FREE_SERIES,
    FB_USED_SERIES,
    GPU_UTIL_SERIES,
    MIG_INSTANCE_LABEL,
    NODE_SERIES_LABEL,
    POWER_USAGE_SERIES,
)
from gpunode.errors import ConfigError, MetricsFeedError

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 15.0
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_AGE_S = 60.0
MAX_RESPONSE_BYTES = 8 * 2**20  # ~80 bytes per node and query: 8 MiB is room for ~100,000 nodes
MAX_NODE_NAME = 253  # a Kubernetes node name is a DNS subdomain
MAX_POWER_W = 10_000.0  # per GPU; no GPU draws more, so a larger figure is a broken answer
NEUTRAL = 0.5  # a term's value for a node Prometheus has no figure for
_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


@dataclass(frozen=True)
class NodeLoad:
    """One node's figures; None where Prometheus had none (or an unusable one)."""

    power_w: float | None = None
    util: float | None = None  # 0..1
    memory: float | None = None  # 0..1


def queries(node_label: str = NODE_SERIES_LABEL) -> dict[str, str]:
    """The PromQL instant queries, by figure, aggregating per-GPU series by the node label."""
    gpu = f'{{{MIG_INSTANCE_LABEL}=""}}'  # the GPUs' own series, not their MIG instances'

    def total(series: str) -> str:
        return f"sum by ({node_label}) ({series}{gpu})"

    used, free = total(FB_USED_SERIES), total(FB_FREE_SERIES)
    return {
        "power": f"avg by ({node_label}) ({POWER_USAGE_SERIES}{gpu})",
        "util": f"avg by ({node_label}) ({GPU_UTIL_SERIES}{gpu})",
        "memory": f"{used} / ({used} + {free})",
    }


# the range each figure must be in, as Prometheus answers it (util in %)
_RANGES: dict[str, tuple[float, float]] = {
    "power": (0.0, MAX_POWER_W),
    "util": (0.0, 100.0),
    "memory": (0.0, 1.0),
}


class FeedMetrics:
    """The extender's own metrics about the feed, in a registry its /metrics endpoint renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.fallback = Counter(
            "gpunode_extender_load_fallback_total",
            "Prioritize answers scored without the energy and load terms (Prometheus unreachable or stale).",
            registry=self.registry,
        )
        self.failures = Counter(
            "gpunode_extender_prometheus_refresh_failures_total",
            "Refreshes of the per-node figures that failed (no answer in time, too large, malformed).",
            registry=self.registry,
        )
        self.rejected = Counter(
            "gpunode_extender_prometheus_rejected_samples_total",
            "Samples in Prometheus's answers skipped as unusable (bad node name or value).",
            registry=self.registry,
        )
        self.age = Gauge(
            "gpunode_extender_prometheus_figures_age_seconds",
            "Seconds since the figures in use were fetched (-1: none yet).",
            registry=self.registry,
        )
        self.nodes = Gauge(
            "gpunode_extender_prometheus_nodes",
            "Nodes with at least one figure in the last good refresh.",
            registry=self.registry,
        )
        self.age.set(-1)


def check_url(url: str) -> str:
    """The base URL of Prometheus without a trailing slash; ConfigError unless http(s)://host[:port][/path]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(
            f"--prometheus-url: expected http(s)://host:port[/path], got {url!r}",
            hint="give the URL Prometheus serves its HTTP API under, e.g. http://prometheus.monitoring:9090",
        )
    return url.rstrip("/")


def check_label(label: str) -> str:
    """A Prometheus label name; ConfigError for anything else (it is pasted into the queries)."""
    if not label or label[0].isdigit() or not set(label) <= _LABEL_CHARS:
        raise ConfigError(
            f"--prometheus-node-label: {label!r} is not a Prometheus label name",
            hint="use the label carrying the node's name on the agents' series: Hostname or hostname",
        )
    return label


def parse_vector(
    raw: bytes, *, node_label: str, lo: float, hi: float, what: str
) -> tuple[dict[str, float], int]:
    """(node -> value, samples skipped) of an instant query's answer; MetricsFeedError when it is no vector."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MetricsFeedError(f"{what}: Prometheus's answer is not JSON: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(data, dict):
        error = str(doc.get("error", ""))[:200] if isinstance(doc, dict) else ""
        raise MetricsFeedError(f"{what}: Prometheus did not answer with a success: {error or 'no data'}")
    result = data.get("result")
    if data.get("resultType") != "vector" or not isinstance(result, list):
        raise MetricsFeedError(f"{what}: Prometheus's answer is not an instant vector")
    out: dict[str, float] = {}
    skipped = 0
    for sample in result:
        node, value = _sample(sample, node_label)
        if node is None or value is None or not lo <= value <= hi or node in out:
            skipped += 1
            continue
        out[node] = value
    return out, skipped


def _sample(sample: object, node_label: str) -> tuple[str | None, float | None]:
    if not isinstance(sample, dict):
        return None, None
    metric, pair = sample.get("metric"), sample.get("value")
    node = metric.get(node_label) if isinstance(metric, dict) else None
    if not isinstance(node, str) or not 0 < len(node) <= MAX_NODE_NAME:
        node = None
    if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], str) or len(pair[1]) > 40:
        return node, None
    try:
        value = float(pair[1])
    except ValueError:
        return node, None
    return node, value if math.isfinite(value) else None


class PromFeed:
    """Per-node figures from Prometheus, refreshed in a thread of its own; figures() never blocks on I/O."""

    def __init__(
        self,
        url: str,
        *,
        node_label: str = NODE_SERIES_LABEL,
        refresh_s: float = DEFAULT_REFRESH_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        metrics: FeedMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (refresh_s > 0 and timeout_s > 0 and max_age_s > 0):
            raise ConfigError(
                "--prometheus-refresh, --prometheus-timeout and --prometheus-max-age must be > 0"
            )
        self.url = check_url(url)
        self.node_label = check_label(node_label)
        self.refresh_s, self.timeout_s, self.max_age_s = refresh_s, timeout_s, max_age_s
        self.max_response_bytes = max_response_bytes
        self.metrics = metrics or FeedMetrics()
        self._clock = clock
        self._queries = queries(self.node_label)
        self._lock = threading.Lock()
        self._figures: tuple[float, dict[str, NodeLoad]] | None = None  # (fetched at, figures)
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = httpx2.Client(
            timeout=httpx2.Timeout(timeout_s),
            follow_redirects=False,
            # identity: no compressed answer can inflate past max_response_bytes inside one chunk
            headers={"Accept": "application/json", "Accept-Encoding": "identity"},
            limits=httpx2.Limits(max_connections=2, max_keepalive_connections=1),
        )
        self.metrics.age.set_function(self._age_s)

    # ----- reading (request threads) --------------------------------------------------------------

    def figures(self) -> Mapping[str, NodeLoad] | None:
        """The last good figures by node name, or None when there are none or they are older than max_age_s."""
        with self._lock:
            got = self._figures
        if got is None or self._clock() - got[0] > self.max_age_s:
            return None
        return got[1]

    def note_fallback(self) -> None:
        """Count one prioritize answer scored without the terms."""
        self.metrics.fallback.inc()

    def _age_s(self) -> float:
        with self._lock:
            got = self._figures
        return -1.0 if got is None else max(0.0, self._clock() - got[0])

    # ----- refreshing (the feed's thread) ---------------------------------------------------------

    def refresh_once(self) -> None:
        """Query Prometheus once and keep the figures; MetricsFeedError (and the old figures kept) on failure."""
        try:
            found: dict[str, dict[str, float]] = {}
            for figure, query in self._queries.items():
                lo, hi = _RANGES[figure]
                raw = self._get(query, figure)
                found[figure], skipped = parse_vector(
                    raw, node_label=self.node_label, lo=lo, hi=hi, what=f"{figure} query"
                )
                self.metrics.rejected.inc(skipped)
        except MetricsFeedError:
            self.metrics.failures.inc()
            raise
        nodes = set().union(*found.values())
        figures = {
            n: NodeLoad(
                power_w=found["power"].get(n),
                util=None if (u := found["util"].get(n)) is None else u / 100.0,
                memory=found["memory"].get(n),
            )
            for n in nodes
        }
        with self._lock:
            self._figures = (self._clock(), figures)
        self.metrics.nodes.set(len(figures))

    def _get(self, query: str, figure: str) -> bytes:
        """The body of one instant query, within timeout_s and max_response_bytes."""
        where = f"{figure} query to Prometheus at {self.url}"
        deadline = time.monotonic() + self.timeout_s
        body = bytearray()
        try:
            with self._client.stream("GET", f"{self.url}/api/v1/query", params={"query": query}) as resp:
                if resp.status_code not in (200, 400, 422, 503):  # the statuses the API answers JSON with
                    raise MetricsFeedError(f"{where}: HTTP {resp.status_code}")
                length = resp.headers.get("Content-Length", "")
                if length.isdigit() and int(length) > self.max_response_bytes:
                    raise MetricsFeedError(
                        f"{where}: answer of {length} bytes is over {self.max_response_bytes}"
                    )
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > self.max_response_bytes:
                        raise MetricsFeedError(f"{where}: answer over {self.max_response_bytes} bytes")
                    if time.monotonic() > deadline:
                        raise MetricsFeedError(f"{where}: no complete answer within {self.timeout_s:g} s")
        except httpx2.TimeoutException:
            raise MetricsFeedError(f"{where}: no answer within {self.timeout_s:g} s") from None
        except httpx2.HTTPError as exc:
            raise MetricsFeedError(f"{where}: {type(exc).__name__}: {exc}") from None
        return bytes(body)

    def _refresh_logged(self) -> None:
        """refresh_once, logging one warning when failures start and one info line when they end."""
        try:
            self.refresh_once()
        except MetricsFeedError as exc:
            if not self._failing:
                self._failing = True
                log.warning(
                    "extender: %s; prioritize scores without the energy and load terms while the figures "
                    "are missing or over %gs old (%s)",
                    exc,
                    self.max_age_s,
                    exc.hint,
                )
            return
        if self._failing:
            self._failing = False
            log.info("extender: Prometheus at %s answers again; energy and load terms back", self.url)

    def start(self) -> None:
        """Refresh now and then every refresh_s in a daemon thread, until stop()."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="extender-promfeed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._refresh_logged()
            except Exception:  # a defect of ours: log it, keep the thread (and the extender) going
                log.exception("extender: refreshing the figures from Prometheus failed")
            self._stop.wait(self.refresh_s)

    def stop(self) -> None:
        """End the refresh thread (waiting at most a request's bound) and close the connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * self.timeout_s + 5)
        self._client.close()


# ----- the scores' terms ----------------------------------------------------------------------------


def terms(
    hosts: Sequence[str], figures: Mapping[str, NodeLoad]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(energy, load) terms in 0..1 for the candidate nodes `hosts`, higher preferred.

    energy: the node's GPU power draw scaled between the lowest (0) and highest (1) among the
    candidates, so nodes already busy are filled first and idle ones stay idle; load: 1 minus the
    mean of its utilisation and memory-used ratios, so lightly loaded nodes are preferred. A node
    without the figure gets NEUTRAL, as do all candidates when their figures are equal.
    """
    power = np.array([_get(figures, h, "power_w") for h in hosts], dtype=np.float64)
    energy = np.full(len(hosts), NEUTRAL)
    known = ~np.isnan(power)
    if known.any():
        lo, hi = power[known].min(), power[known].max()
        if hi > lo:
            energy[known] = (power[known] - lo) / (hi - lo)
    busy = np.array(
        [[_get(figures, h, "util"), _get(figures, h, "memory")] for h in hosts], dtype=np.float64
    ).reshape(len(hosts), 2)
    counted = (~np.isnan(busy)).sum(axis=1)
    mean = np.divide(np.nansum(busy, axis=1), counted, out=np.full(len(hosts), NEUTRAL), where=counted > 0)
    return energy, 1.0 - mean


def _get(figures: Mapping[str, NodeLoad], host: str, field: str) -> float:
    load = figures.get(host)
    value = None if load is None else getattr(load, field)
    return math.nan if value is None else float(value)


class LoadFeed(Protocol):
    """Per-node figures for the energy and load terms (PromFeed)."""

    metrics: FeedMetrics

    def figures(self) -> Mapping[str, NodeLoad] | None:
        """The figures by node name; None when unavailable or stale (score without the terms)."""
        ...

    def note_fallback(self) -> None:
        """Count one answer scored without the terms."""
        ...


def blend(
    raw: npt.NDArray[np.float64],
    scored_at: npt.NDArray[np.intp],
    hosts: Sequence[str],
    feed: LoadFeed,
    energy_weight: float,
    load_weight: float,
) -> npt.NDArray[np.float64]:
    """The policy's scores of the fitting nodes (at `scored_at`, named `hosts`) scaled to 0..1, plus the
    weighted energy and load terms; NaN elsewhere. Both weights 0: `raw` unchanged; stale or no figures:
    `raw` unchanged and the fallback counted."""
    if energy_weight == 0 and load_weight == 0:
        return raw
    figures = feed.figures()
    if figures is None:
        feed.note_fallback()
        return raw
    policy = raw[scored_at]
    lo, hi = policy.min(), policy.max()
    scaled = (policy - lo) / (hi - lo) if hi > lo else np.ones(len(policy))
    energy, load = terms(hosts, figures)
    out = np.full(len(raw), np.nan)
    out[scored_at] = scaled + energy_weight * energy + load_weight * load
    return out
