"""The power table, the energy model (busy / idle on powered nodes / dark) and the meter."""

from __future__ import annotations

import pytest

from gpunode.cluster.queueing.capacity import ClusterCapacity
from gpunode.cluster.queueing.energy import (
    DEFAULT_POWER,
    FALLBACK_WATTS,
    POWER_TABLE,
    EnergyMeter,
    GpuActivity,
    GpuSeconds,
    PowerModel,
    energy_kwh,
)
from gpunode.cluster.queueing.model import Job
from gpunode.errors import InvalidRequest
from gpunode.placement.model import GpuState, NodeState, Request

OPENB_MODELS = ("G2", "G3", "T4", "P100", "V100M16", "V100M32", "A10")


def node(name: str, gpus: int, model: str) -> NodeState:
    """An empty node of fractional GPUs."""
    return NodeState(
        name=name,
        gpus=tuple(
            GpuState(
                uuid=f"{name}/gpu{j}",
                index=j,
                model=model,
                milli_free=1000,
                memory_total_bytes=0,
                memory_free_bytes=0,
                numa_node=None,
            )
            for j in range(gpus)
        ),
        cpu_milli_free=64000,
        memory_free_bytes=1 << 40,
    )


def test_table_covers_the_openb_and_simulated_models() -> None:
    for model in (*OPENB_MODELS, "A100", "H100"):
        idle, active = POWER_TABLE[model]
        assert 0 < idle < active
    # the simulated profiles' figures (gpunode/node/devices/simnode/profiles)
    assert POWER_TABLE["T4"] == (10.0, 70.0)
    assert POWER_TABLE["A100"] == (60.0, 400.0)
    assert POWER_TABLE["H100"] == (70.0, 700.0)


def test_models_match_by_name_or_word_else_fallback() -> None:
    assert DEFAULT_POWER.watts("NVIDIA A100-SXM4-80GB") == POWER_TABLE["A100"]
    assert DEFAULT_POWER.watts("NVIDIA H100 80GB HBM3") == POWER_TABLE["H100"]
    assert DEFAULT_POWER.watts("Tesla T4") == POWER_TABLE["T4"]
    assert DEFAULT_POWER.watts("V100M16") == POWER_TABLE["V100M16"]
    assert DEFAULT_POWER.watts("Mystery-9000") == FALLBACK_WATTS
    assert DEFAULT_POWER.watts("") == FALLBACK_WATTS


def test_a_power_table_with_idle_above_active_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="idle") as info:
        PowerModel(table={"X": (100.0, 50.0)})
    assert "\n" not in str(info.value)


def test_energy_by_hand() -> None:
    # one T4 busy for an hour (70 Wh), three T4 idle on its node for an hour (3 x 10 Wh),
    # and two hours of a dark V100 (0 unless priced)
    seconds = {"T4": GpuSeconds(busy=3600, idle=3 * 3600), "V100M32": GpuSeconds(dark=7200)}
    busy, idle = energy_kwh(seconds)
    assert busy == pytest.approx(0.070)
    assert idle == pytest.approx(0.030)
    _, priced = energy_kwh(seconds, dark_w=5.0)
    assert priced == pytest.approx(0.030 + 2 * 5 / 1000)


def test_meter_integrates_piecewise_constant_activity() -> None:
    meter = EnergyMeter()
    meter.observe(0.0, {"T4": GpuActivity(busy=1, idle_powered=1, dark=2)})
    meter.observe(10.0, {"T4": GpuActivity(busy=2, idle_powered=0, dark=2)})
    meter.observe(15.0, {"T4": GpuActivity(busy=0, idle_powered=0, dark=4)})
    s = meter.seconds["T4"]
    assert (s.busy, s.idle, s.dark) == (20.0, 10.0, 30.0)
    with pytest.raises(InvalidRequest, match="back"):
        meter.observe(14.0, {})


def test_capacity_activity_follows_the_model() -> None:
    cap = ClusterCapacity([node("a", 4, "T4"), node("b", 4, "T4"), node("c", 2, "V100M32")], policy="bestfit")
    assert cap.nodes_busy() == 0
    assert cap.gpu_activity() == {
        "T4": GpuActivity(busy=0, idle_powered=0, dark=8),
        "V100M32": GpuActivity(busy=0, idle_powered=0, dark=2),
    }
    # two fractions on one GPU count one busy GPU; a CPU pod powers nothing
    j = Job(
        name="j",
        queue="q",
        pods=(
            Request(gpu_milli=300, gpu_models=frozenset({"T4"})),
            Request(gpu_milli=300),
            Request(cpu_milli=1),
        ),
        arrival=0,
    )
    plan = cap.plan(j, exclude_nodes=frozenset({"b", "c"}))
    assert plan is not None
    cap.commit("j", j, plan)
    assert cap.nodes_busy() == 1
    assert cap.gpu_activity()["T4"] == GpuActivity(busy=1, idle_powered=3, dark=4)
    assert cap.gpu_activity()["V100M32"] == GpuActivity(busy=0, idle_powered=0, dark=2)
    cap.release("j")
    assert cap.gpu_activity()["T4"] == GpuActivity(busy=0, idle_powered=0, dark=8)


def test_energy_weight_keeps_dark_nodes_dark_and_prefers_cheap_gpus() -> None:
    """Spread alone powers a node per job; with the energy term the jobs share the powered node."""

    def run(weight: float) -> int:
        cap = ClusterCapacity(
            [node(f"n{i}", 8, "G2") for i in range(4)], policy="spread", energy_weight=weight
        )
        for i in range(4):
            j = Job(name=f"j{i}", queue="q", pods=(Request(gpus=1),), arrival=0)
            plan = cap.plan(j)
            assert plan is not None
            cap.commit(j.name, j, plan)
        return cap.nodes_busy()

    assert run(0.0) == 4
    assert run(0.6) == 1
    # between a dark T4 node and a dark V100 node, the cheaper one powers up
    cap = ClusterCapacity([node("v", 2, "V100M32"), node("t", 2, "T4")], policy="spread", energy_weight=1.0)
    plan = cap.plan(Job(name="x", queue="q", pods=(Request(gpus=1),), arrival=0))
    assert plan is not None and plan.nodes == {"t"}


def test_extra_watts_by_hand() -> None:
    """One T4 turning busy: 60 W on a powered node, 70 + 3 x 10 W powering a dark 4-GPU node up."""
    import numpy as np

    from gpunode.cluster.queueing.energy import extra_watts_rank

    newly = np.array([1.0, 1.0, 0.0, 1.0])
    dark = np.array([False, True, True, True])
    gpus = np.array([4, 4, 4, 2])
    idle, active = np.full(4, 10.0), np.full(4, 70.0)
    # extra watts: 60, 100, 0 (a CPU pod powers nothing), 80 -> ranked (100 - x) / 100
    assert extra_watts_rank(newly, dark, gpus, idle, active).tolist() == [0.4, 0.0, 1.0, 0.2]
    assert extra_watts_rank(newly[:1], dark[:1], gpus[:1], idle[:1], active[:1]).tolist() == [1.0]
