"""The extender's node cache: freshness against a node state from the future, and its bounds on nodes."""

from __future__ import annotations

from typing import Any

from gpunode.cluster.extender.core import Extender
from gpunode.cluster.extender.nodes import NodeCache
from gpunode.contract.nodestate import GpuRecord, NodeGpuState, encode
from tests.cluster.test_extender import v1_node, v1_pod

GIB = 2**30
NOW = 1_790_000_000.0
POD = v1_pod("p", limits={"nvidia.com/gpu": "1"}, uid="uid-p")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def node(name: str, updated: float, generation: int = 1) -> dict[str, Any]:
    state = NodeGpuState(
        node=name,
        updated=updated,
        generation=generation,
        gpus=(GpuRecord(f"GPU-{name}-0", 0, "NVIDIA H100", 80 * GIB),),
    )
    return v1_node(name, encode(state))


def passing(extender: Extender, *nodes: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    result = extender.filter({"Pod": POD, "Nodes": {"items": list(nodes)}})
    return [n["metadata"]["name"] for n in result["Nodes"]["items"]], result["FailedNodes"]


def test_a_node_state_from_the_future_fails_its_node() -> None:
    """The issue's attack: "updated": 1e18 (and one hour ahead) passed as fresh for ever. Beyond the skew
    allowed, the node fails with the reason; a few seconds ahead (clocks differ) still passes."""
    clock = Clock(NOW)
    extender = Extender(nodes=NodeCache(max_age_s=180, max_skew_s=65, clock=clock))
    far, hour, near = node("far", 1e18), node("hour", NOW + 3600), node("near", NOW + 5)
    passed, failed = passing(extender, far, hour, near)
    assert passed == ["near"]
    assert "3600 s in the future" in failed["hour"] and "--node-state-max-skew" in failed["hour"]
    assert "in the future" in failed["far"] or "updated: expected" in failed["far"]
    scores = extender.prioritize({"Pod": POD, "Nodes": {"items": [far, hour, near]}})
    assert {s["Host"]: s["Score"] for s in scores}["hour"] == 0


def test_a_frozen_annotation_goes_stale_by_the_extenders_own_clock() -> None:
    """An annotation whose `updated` is ahead (within the skew) and never changes goes stale once the
    extender has seen it unchanged for longer than the max age; a republished one stays fresh."""
    clock = Clock(NOW)
    extender = Extender(nodes=NodeCache(max_age_s=180, max_skew_s=10_000, clock=clock))
    frozen = node("frozen", NOW + 5000)
    assert passing(extender, frozen)[0] == ["frozen"]
    clock.now += 170
    assert passing(extender, frozen)[0] == ["frozen"]
    clock.now += 20
    passed, failed = passing(extender, frozen, node("live", clock.now - 1))
    assert passed == ["live"]
    assert "unchanged for 190 s as the extender saw it" in failed["frozen"]
    assert passing(extender, node("frozen", NOW + 5001, generation=2))[0] == ["frozen"]  # it changed


def test_the_cache_forgets_nodes_not_seen_and_keeps_at_most_max_nodes() -> None:
    """50 distinct node names through a cache of 10: the cache holds 10, the least recently seen go
    first, the GPU supply follows, and nodes not seen for the TTL are forgotten."""
    clock = Clock(NOW)
    cache = NodeCache(max_nodes=10, ttl_s=600, clock=clock)
    extender = Extender(nodes=cache)
    for i in range(50):
        assert passing(extender, node(f"n{i}", NOW), node("kept", NOW))[0] == [f"n{i}", "kept"]
    assert len(cache) == 10 and cache.forgotten == 41
    assert cache.gpu_supply() == {"NVIDIA H100": 10}
    assert {v.name for v in cache.views()} == {"kept", *(f"n{i}" for i in range(41, 50))}
    clock.now += 300
    cache.get_many(["kept"])
    clock.now += 301
    cache.update([node("other", clock.now)])
    assert sorted(v.name for v in cache.views()) == ["kept", "other"]
    assert passing(extender, node("n3", clock.now))[0] == ["n3"]  # a forgotten node comes back


def test_the_cache_size_is_a_metric() -> None:
    from prometheus_client import generate_latest

    extender = Extender(nodes=NodeCache(max_nodes=2))
    passing(extender, node("a", NOW), node("b", NOW), node("c", NOW))
    text = generate_latest(extender.metrics.registry).decode()
    assert "gpunode_extender_nodes_cached 2.0" in text
    assert "gpunode_extender_nodes_forgotten_total 1.0" in text


def test_the_node_cache_and_request_memory_flags() -> None:
    import argparse

    import pytest

    from gpunode.cluster.extender.cli import build_extender, register_extender_cli, server_options
    from gpunode.errors import ConfigError

    root = argparse.ArgumentParser()
    register_extender_cli(root.add_subparsers())

    def args(*flags: str) -> argparse.Namespace:
        return root.parse_args(["extender", *flags])

    cache = build_extender(args())[0].nodes
    assert (cache.max_skew_s, cache.ttl_s, cache.max_nodes) == (65, 3600, 8_000)
    flags = ("--node-state-max-skew", "10s", "--node-cache-ttl", "0s", "--node-cache-max-nodes", "500")
    cache = build_extender(args(*flags))[0].nodes
    assert (cache.max_skew_s, cache.ttl_s, cache.max_nodes) == (10, None, 500)
    assert server_options(args())["request_memory_bytes"] == 256 * 2**20
    assert server_options(args("--request-memory", "1Gi"))["request_memory_bytes"] == 2**30
    with pytest.raises(ConfigError, match="--node-cache-max-nodes"):
        build_extender(args("--node-cache-max-nodes", "0"))
    with pytest.raises(ConfigError, match="--request-memory"):
        server_options(args("--request-memory", "8Mi"))
