"""The extender's Prometheus feed against a stand-in for Prometheus's HTTP API: parsing, hostile answers, fallback.

The stand-in serves /api/v1/query over real loopback HTTP and answers each of the
feed's three queries (power, utilisation, memory) with whatever a test sets:
good vectors, broken JSON, NaN and huge values, unknown nodes, an endless
trickle, a body over the size bound. The extender's scores are then checked
over its real HTTP server, /metrics included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gpunode.cluster.extender.cli import build_extender, register_extender_cli
from gpunode.cluster.extender.core import Extender, ExtenderConfig
from gpunode.cluster.extender.promfeed import (
    MAX_POWER_W,
    FeedMetrics,
    NodeLoad,
    PromFeed,
    parse_vector,
    queries,
    terms,
)
from gpunode.cluster.extender.server import ExtenderServer
from gpunode.errors import ConfigError, InvalidRequest, MetricsFeedError
from tests.cluster.test_extender import Client, PodBook, gpu_state, node_list, v1_node, v1_pod
from tests.ports import free_port

Reply = Callable[[BaseHTTPRequestHandler], None]


def vector(figures: dict[str, object], label: str = "Hostname") -> bytes:
    """A Prometheus instant-vector answer: one sample per node, values as Prometheus writes them."""
    result = [{"metric": {label: n}, "value": [1732252800.123, str(v)]} for n, v in figures.items()]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


def send(handler: BaseHTTPRequestHandler, body: bytes, status: int = 200) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class StandIn:
    """Prometheus's /api/v1/query on loopback; `replies` maps a figure (power, util, memory) to its answer."""

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {}
        self.asked: list[str] = []
        self.by_query = {q: f for f, q in queries().items()}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query).get("query", [""])[0]
                figure = owner.by_query.get(query, "")
                owner.asked.append(figure or query)
                reply = owner.replies.get(figure)
                if url.path != "/api/v1/query" or reply is None:
                    send(self, b'{"status":"error","errorType":"bad_data","error":"unknown query"}', 400)
                    return
                with contextlib.suppress(OSError):  # the feed hung up (a trickle, an oversized answer)
                    reply(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, power: dict[str, object], util: dict[str, object], memory: dict[str, object]) -> None:
        for figure, values in (("power", power), ("util", util), ("memory", memory)):
            body = vector(values)
            self.replies[figure] = lambda h, b=body: send(h, b)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prom() -> Iterator[StandIn]:
    stand_in = StandIn()
    yield stand_in
    stand_in.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def feed_for(prom: StandIn, **kwargs: Any) -> PromFeed:
    kwargs.setdefault("timeout_s", 5.0)
    return PromFeed(prom.url, **kwargs)


# ----- parsing ----------------------------------------------------------------------------------------


def parse(raw: bytes, lo: float = 0.0, hi: float = 100.0) -> tuple[dict[str, float], int]:
    return parse_vector(raw, node_label="Hostname", lo=lo, hi=hi, what="test query")


def test_a_vector_answer_gives_one_figure_per_node() -> None:
    assert parse(vector({"gpu-a": "42.5", "gpu-b": 0})) == ({"gpu-a": 42.5, "gpu-b": 0.0}, 0)
    assert parse(vector({})) == ({}, 0)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"<html>502 Bad Gateway</html>",
        b'{"status": "success", "data": {"resultType": "vector", "result": [NaN]}}',  # not JSON
        b"[" * 5000 + b"]" * 5000,  # nesting beyond the decoder's limit
        b"[]",
        b'{"status": "error", "errorType": "timeout", "error": "query timed out\\nin expression evaluation"}',
        b'{"status": "success"}',
        b'{"status": "success", "data": {"resultType": "matrix", "result": []}}',
        b'{"status": "success", "data": {"resultType": "vector", "result": {"gpu-a": 1}}}',
        b'{"status": "success", "data": []}',
    ],
)
def test_an_answer_that_is_no_vector_fails_the_refresh_in_one_line(raw: bytes) -> None:
    with pytest.raises(MetricsFeedError) as info:
        parse(raw)
    assert "\n" not in str(info.value) and str(info.value).startswith("test query: ")
    assert "--prometheus-url" in info.value.hint


def test_unusable_samples_are_skipped_and_counted() -> None:
    good = {"metric": {"Hostname": "gpu-ok"}, "value": [1.0, "7"]}
    hostile: list[object] = [
        {"metric": {"Hostname": "nan"}, "value": [1.0, "NaN"]},
        {"metric": {"Hostname": "inf"}, "value": [1.0, "+Inf"]},
        {"metric": {"Hostname": "overflow"}, "value": [1.0, "1e400"]},
        {"metric": {"Hostname": "huge"}, "value": [1.0, "1e300"]},
        {"metric": {"Hostname": "negative"}, "value": [1.0, "-3"]},
        {"metric": {"Hostname": "number"}, "value": [1.0, 7]},  # Prometheus writes values as strings
        {"metric": {"Hostname": "long-value"}, "value": [1.0, "7" + "0" * 5000]},
        {"metric": {"Hostname": "words"}, "value": [1.0, "seven"]},
        {"metric": {"Hostname": "short"}, "value": [1.0]},
        {"metric": {"Hostname": "x" * 254}, "value": [1.0, "7"]},
        {"metric": {"Hostname": ""}, "value": [1.0, "7"]},
        {"metric": {"Hostname": ["gpu-a"]}, "value": [1.0, "7"]},
        {"metric": {"instance": "10.0.0.1:9400"}, "value": [1.0, "7"]},
        {"metric": "gpu-a", "value": [1.0, "7"]},
        "gpu-a",
        None,
        {"metric": {"Hostname": "gpu-ok"}, "value": [1.0, "99"]},  # a duplicate: the first stays
    ]
    raw = json.dumps(
        {"status": "success", "data": {"resultType": "vector", "result": [good, *hostile]}}
    ).encode()
    assert parse(raw) == ({"gpu-ok": 7.0}, len(hostile))


# ----- the feed over HTTP --------------------------------------------------------------------------------


def test_refresh_reads_the_three_figures_of_every_node(prom: StandIn) -> None:
    prom.answer(
        power={"gpu-a": "250", "gpu-b": "60.5"},
        util={"gpu-a": "90", "gpu-c": "NaN"},
        memory={"gpu-a": "0.5", "gpu-b": "0.125", "gpu-c": "1.5"},
    )
    feed = feed_for(prom)
    try:
        assert feed.figures() is None  # nothing fetched yet
        feed.refresh_once()
        assert feed.figures() == {
            "gpu-a": NodeLoad(power_w=250.0, util=0.9, memory=0.5),
            "gpu-b": NodeLoad(power_w=60.5, memory=0.125),
        }
        assert sorted(prom.asked) == ["memory", "power", "util"]
        metric = feed.metrics.registry.get_sample_value
        assert metric("gpunode_extender_prometheus_rejected_samples_total") == 2.0
        assert metric("gpunode_extender_prometheus_nodes") == 2.0
    finally:
        feed.stop()


def test_the_queries_leave_mig_instances_out_and_use_the_configured_label() -> None:
    q = queries("hostname")
    assert q["power"] == 'avg by (hostname) (DCGM_FI_DEV_POWER_USAGE{GPU_I_ID=""})'
    assert q["util"] == 'avg by (hostname) (DCGM_FI_DEV_GPU_UTIL{GPU_I_ID=""})'
    assert 'sum by (hostname) (DCGM_FI_DEV_FB_FREE{GPU_I_ID=""})' in q["memory"]


def test_figures_go_stale_after_max_age_and_a_failure_keeps_the_old_ones(prom: StandIn) -> None:
    clock = Clock()
    prom.answer(power={"gpu-a": "100"}, util={}, memory={})
    feed = feed_for(prom, max_age_s=30.0, clock=clock)
    try:
        feed.refresh_once()
        prom.replies["power"] = lambda h: send(h, b"{broken")
        with pytest.raises(MetricsFeedError):
            feed.refresh_once()
        clock.now += 30.0
        assert feed.figures() == {"gpu-a": NodeLoad(power_w=100.0)}  # the last good set, still fresh
        clock.now += 0.5
        assert feed.figures() is None
        assert (
            feed.metrics.registry.get_sample_value("gpunode_extender_prometheus_refresh_failures_total") == 1
        )
    finally:
        feed.stop()


def test_an_answer_over_the_size_bound_is_refused(prom: StandIn) -> None:
    prom.answer(power={"gpu-a": "100"}, util={}, memory={})
    big = vector({f"node-{i:05d}": "100" for i in range(2000)})
    prom.replies["util"] = lambda h: send(h, big)

    def no_length(h: BaseHTTPRequestHandler) -> None:  # a body with no Content-Length, read to EOF
        h.protocol_version = "HTTP/1.0"
        h.send_response(200)
        h.end_headers()
        h.wfile.write(big)

    feed = feed_for(prom, max_response_bytes=len(big) - 1)
    try:
        with pytest.raises(MetricsFeedError, match="over"):
            feed.refresh_once()
        prom.replies["util"] = no_length
        with pytest.raises(MetricsFeedError, match=f"answer over {len(big) - 1} bytes"):
            feed.refresh_once()
        assert feed.figures() is None
    finally:
        feed.stop()


def test_an_answer_trickled_forever_is_cut_off(prom: StandIn) -> None:
    stop = threading.Event()

    def trickle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(10**9))
        h.end_headers()
        while not stop.is_set():  # a byte now and then: each read succeeds, the whole never ends
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.05)

    prom.replies["power"] = trickle
    feed = feed_for(prom, timeout_s=1.0, max_response_bytes=2 * 10**9)
    try:
        with pytest.raises(MetricsFeedError, match="no complete answer within 1 s"):
            feed.refresh_once()
    finally:
        stop.set()
        feed.stop()


def test_a_server_that_never_answers_times_out(prom: StandIn) -> None:
    release = threading.Event()
    prom.replies["power"] = lambda h: release.wait(60)
    feed = feed_for(prom, timeout_s=0.5)
    try:
        with pytest.raises(MetricsFeedError, match=r"no answer within 0\.5 s"):
            feed.refresh_once()
    finally:
        release.set()
        feed.stop()


def test_http_errors_and_prometheus_errors_name_the_query(prom: StandIn) -> None:
    prom.answer(power={}, util={}, memory={})
    prom.replies["memory"] = lambda h: send(h, b"oops", 500)
    feed = feed_for(prom)
    try:
        with pytest.raises(MetricsFeedError, match=r"memory query to Prometheus at .*: HTTP 500"):
            feed.refresh_once()
        error = b'{"status":"error","errorType":"execution","error":"many-to-many matching not allowed"}'
        prom.replies["memory"] = lambda h: send(h, error, 422)
        with pytest.raises(MetricsFeedError, match="many-to-many matching not allowed"):
            feed.refresh_once()
    finally:
        feed.stop()


def closed_port() -> int:
    return free_port()  # nothing listens there


def test_the_refresher_warns_once_per_outage_and_once_on_recovery(
    prom: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    feed = PromFeed(f"http://127.0.0.1:{closed_port()}", timeout_s=2.0)
    caplog.set_level(logging.INFO, logger="gpunode.cluster.extender.promfeed")
    try:
        for _ in range(3):
            feed._refresh_logged()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, caplog.text
        assert "ConnectError" in warnings[0].getMessage() and "--prometheus-url" in warnings[0].getMessage()
        assert (
            feed.metrics.registry.get_sample_value("gpunode_extender_prometheus_refresh_failures_total") == 3
        )
        prom.answer(power={"gpu-a": "1"}, util={}, memory={})
        feed.url = prom.url  # the same feed, Prometheus now reachable
        feed._refresh_logged()
        feed._refresh_logged()
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
        assert feed.figures() == {"gpu-a": NodeLoad(power_w=1.0)}
    finally:
        feed.stop()


def test_the_refresher_thread_keeps_the_figures_current(prom: StandIn) -> None:
    prom.answer(power={"gpu-a": "100"}, util={}, memory={})
    feed = feed_for(prom, refresh_s=0.05)
    feed.start()
    try:
        wait_for(lambda: feed.figures() == {"gpu-a": NodeLoad(power_w=100.0)})
        prom.answer(power={"gpu-a": "300"}, util={}, memory={})
        wait_for(lambda: feed.figures() == {"gpu-a": NodeLoad(power_w=300.0)})
    finally:
        feed.stop()


def wait_for(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ----- the terms and the extender's scores -----------------------------------------------------------------


def test_terms_prefer_busy_nodes_for_energy_and_idle_ones_for_load() -> None:
    figures = {
        "busy": NodeLoad(power_w=400.0, util=0.9, memory=0.7),
        "idle": NodeLoad(power_w=60.0, util=0.0, memory=0.0),
        "half": NodeLoad(power_w=230.0, util=0.5),
        "stranger": NodeLoad(power_w=MAX_POWER_W, util=1.0, memory=1.0),  # not a candidate: no effect
    }
    energy, load = terms(["busy", "idle", "half", "unknown"], figures)
    assert energy.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert load.tolist() == pytest.approx([0.2, 1.0, 0.5, 0.5])
    energy, load = terms(["a", "b"], {"a": NodeLoad(power_w=70.0), "b": NodeLoad(power_w=70.0)})
    assert energy.tolist() == [0.5, 0.5] and load.tolist() == [0.5, 0.5]


class FixedFeed:
    """A LoadFeed with figures set by the test (None: stale)."""

    def __init__(self, figures: dict[str, NodeLoad] | None) -> None:
        self.metrics = FeedMetrics()
        self.current = figures

    def figures(self) -> dict[str, NodeLoad] | None:
        return self.current

    def note_fallback(self) -> None:
        self.metrics.fallback.inc()


NODES = node_list(*(v1_node(n, gpu_state(n, [1000, 1000])) for n in ("gpu-a", "gpu-b", "gpu-c")))
BUSY_A = {
    "gpu-a": NodeLoad(power_w=300.0, util=0.8, memory=0.6),
    "gpu-b": NodeLoad(power_w=70.0, util=0.0, memory=0.0),
}


def scores(extender: Extender) -> dict[str, int]:
    server = ExtenderServer(extender, port=0)
    server.start()
    try:
        status, result = Client(server.port).post("prioritize", {"Pod": v1_pod(), "Nodes": NODES})
    finally:
        server.stop()
    assert status == 200
    return {r["Host"]: r["Score"] for r in result}


def test_energy_weight_prefers_the_busy_node_and_load_weight_the_idle_one() -> None:
    energy_only = ExtenderConfig(energy_weight=1.0, load_weight=0.0, provisional_reservations=False)
    load_only = ExtenderConfig(energy_weight=0.0, load_weight=1.0, provisional_reservations=False)
    assert scores(Extender(config=energy_only, load_feed=FixedFeed(BUSY_A))) == {
        "gpu-a": 10,
        "gpu-b": 0,
        "gpu-c": 5,  # no figures: neutral
    }
    assert scores(Extender(config=load_only, load_feed=FixedFeed(BUSY_A))) == {
        "gpu-a": 0,
        "gpu-b": 10,
        "gpu-c": 3,  # (1.5 - 1.3) / (2.0 - 1.3) of the way
    }


def test_without_usable_figures_scores_are_the_policys_and_the_fallback_is_counted() -> None:
    config = ExtenderConfig(provisional_reservations=False)
    plain = scores(Extender(config=config))
    stale = FixedFeed(None)
    extender = Extender(config=config, load_feed=stale)
    assert scores(extender) == plain == {"gpu-a": 10, "gpu-b": 10, "gpu-c": 10}
    assert scores(extender) == plain
    assert stale.metrics.registry.get_sample_value("gpunode_extender_load_fallback_total") == 2
    weightless = ExtenderConfig(energy_weight=0, load_weight=0, provisional_reservations=False)
    assert scores(Extender(config=weightless, load_feed=FixedFeed(BUSY_A))) == plain


def test_the_provisional_reservation_goes_to_the_node_the_terms_prefer() -> None:
    extender = Extender(
        config=ExtenderConfig(energy_weight=1, load_weight=0),
        load_feed=FixedFeed(BUSY_A),
        pod_reader=PodBook(v1_pod()).read,
    )
    scores(extender)
    assert extender.reservations.nodes() == frozenset({"gpu-a"})


def test_metrics_endpoint_shows_the_fallback_counter_on_both_ports() -> None:
    feed = FixedFeed(None)
    feed.metrics.fallback.inc(3)
    server = ExtenderServer(Extender(load_feed=feed), port=0, health_port=0, health_host="127.0.0.1")
    server.start()
    try:
        for port in (server.port, server.health_port):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                assert "gpunode_extender_load_fallback_total 3.0" in r.read().decode()
        status, _ = Client(server.port).call("POST", "/metrics", {})
        assert status == 405
    finally:
        server.stop()


# ----- flags -------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    register_extender_cli(p.add_subparsers(dest="command"))
    return p


def test_prometheus_flags_build_a_feed_with_the_weights(prom: StandIn) -> None:
    args = parser().parse_args(
        [
            *("extender", "--prometheus-url", prom.url + "/", "--prometheus-refresh", "2s"),
            *(
                "--prometheus-timeout",
                "1s",
                "--prometheus-max-age",
                "10s",
                "--prometheus-node-label",
                "hostname",
            ),
            *("--energy-weight", "2", "--load-weight", "0"),
        ]
    )
    extender, _ = build_extender(args)
    feed = extender.load_feed
    assert isinstance(feed, PromFeed) and extender.metrics is feed.metrics
    try:
        assert (feed.url, feed.node_label) == (prom.url, "hostname")
        assert (feed.refresh_s, feed.timeout_s, feed.max_age_s) == (2.0, 1.0, 10.0)
        assert (extender.config.energy_weight, extender.config.load_weight) == (2.0, 0.0)
    finally:
        feed.stop()
    extender, _ = build_extender(parser().parse_args(["extender"]))
    assert extender.load_feed is None


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--prometheus-url", "prometheus:9090"], "--prometheus-url: expected http"),
        (["--prometheus-url", "http://p:9090/?x=1"], "--prometheus-url: expected http"),
        (["--prometheus-url", "http://p:9090", "--prometheus-node-label", 'a"}) or vector(1'], "label name"),
        (["--prometheus-url", "http://p:9090", "--prometheus-refresh", "0s"], "must be > 0"),
        (["--energy-weight", "nan"], "energy and load weights"),
        (["--load-weight", "-1"], "energy and load weights"),
        (["--load-weight", "1e9"], "energy and load weights"),
    ],
)
def test_bad_prometheus_flags_are_one_line_config_errors(argv: list[str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        build_extender(parser().parse_args(["extender", *argv]))
    assert "\n" not in str(info.value)


def test_weights_are_checked_by_the_config() -> None:
    with pytest.raises(InvalidRequest):
        ExtenderConfig(energy_weight=float("inf"))
