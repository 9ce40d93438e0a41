"""The workload family's generator: the same replay per (workload, seed), its parameters honoured, the split fixed."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from gpunode.cluster.timesim.family import (
    BURST,
    CLUSTERS,
    DAY,
    FAMILY_SIZE,
    MIXES,
    OPTIMISM,
    WEEK,
    Workload,
    cluster_gpus,
    family,
    generate,
    halves,
    nodes_of,
    queue_config,
)
from gpunode.contract.names import MILLI_PER_GPU

# Written down when the split was decided, before any tuning: changing it needs a new evaluation half.
TUNING = (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22)


def _w(**kw: object) -> Workload:
    base: dict[str, object] = {
        "mix": "four",
        "arrival": "poisson",
        "cluster": "all8",
        "load": 0.9,
        "horizon_s": DAY,
        "estimates": "exact",
    }
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


def test_same_seed_same_jobs_other_seed_other_jobs() -> None:
    w = family()[7]
    a, b, c = generate(w, 1), generate(w, 1), generate(w, 2)
    assert a.jobs == b.jobs
    assert a.offered_load == b.offered_load
    assert a.jobs != c.jobs


def test_workload_key_does_not_depend_on_its_index() -> None:
    w = family()[3]
    twin = Workload(w.mix, w.arrival, w.cluster, w.load, w.horizon_s, w.estimates)
    assert generate(w, 0).jobs == generate(twin, 0).jobs


@pytest.mark.parametrize("load", [0.6, 1.1])
def test_offered_load_is_the_target_on_average(load: float) -> None:
    offered = [generate(_w(load=load), seed).offered_load for seed in range(8)]
    assert abs(float(np.mean(offered)) - load) < 0.1 * load
    assert all(0.6 * load < x < 1.5 * load for x in offered)


def test_jobs_arrive_inside_the_horizon_and_go_to_the_mix_tenants() -> None:
    for horizon in (DAY, WEEK):
        replay = generate(_w(mix="big", horizon_s=horizon), 0)
        assert all(0 <= j.arrival < horizon for j in replay.jobs)
        assert {j.queue for j in replay.jobs} == {t for t, _ in MIXES["big"]}
        assert len({j.name for j in replay.jobs}) == len(replay.jobs)
    assert set(queue_config(_w(mix="big")).leaves) == {t for t, _ in MIXES["big"]}


def test_tenant_shares_of_gpu_time_follow_the_mix() -> None:
    got: dict[str, float] = dict.fromkeys(MIXES["research"][0][:1], 0.0)
    for seed in range(4):
        for j in generate(_w(mix="research"), seed).jobs:
            got[j.queue] = got.get(j.queue, 0.0) + j.gpu_milli / MILLI_PER_GPU * min(
                j.duration or 0.0, DAY - j.arrival
            )
    whole = sum(got.values())
    for tenant, share in MIXES["research"]:
        assert abs(got[tenant] / whole - share) < 0.1


def test_cluster_shapes() -> None:
    for shape, groups in CLUSTERS.items():
        nodes = nodes_of(shape)
        assert sum(len(n.gpus) for n in nodes) == cluster_gpus(shape) == 256
        assert Counter(len(n.gpus) for n in nodes) == Counter(
            {g: sum(c for gg, _, c in groups if gg == g) for g, _, _ in groups}
        )
    assert {g.model for n in nodes_of("twomodel") for g in n.gpus} == {"A100", "H100"}


def test_pinned_jobs_only_on_two_model_clusters() -> None:
    pinned = [j for j in generate(_w(cluster="twomodel"), 0).jobs if j.pods[0].gpu_models]
    assert pinned and all((j.pods[0].gpu_models or set()) <= {"A100", "H100"} for j in pinned)
    assert not any(j.pods[0].gpu_models for j in generate(_w(cluster="all8"), 0).jobs)


def test_gangs_are_8_gpu_pods_and_whole_jobs_fit_a_node() -> None:
    jobs = generate(_w(mix="big", cluster="mixed"), 0).jobs
    gangs = [j for j in jobs if j.gang]
    assert gangs and all(p.gpus == 8 for j in gangs for p in j.pods)
    assert all(j.pods[0].gpus <= 8 for j in jobs if not j.gang)
    assert any(0 < j.pods[0].gpu_milli < MILLI_PER_GPU for j in generate(_w(), 0).jobs)


def test_estimate_modes() -> None:
    exact = generate(_w(estimates="exact"), 0).jobs
    assert all(j.runtime_estimate == j.duration for j in exact)
    assert all(j.runtime_estimate is None for j in generate(_w(estimates="missing"), 0).jobs)
    for sigma in (0.5, 1.0):
        jobs = generate(_w(estimates=f"noisy{sigma}", mix="research"), 0).jobs
        logs = [math.log(j.runtime_estimate / j.duration) for j in jobs if j.runtime_estimate and j.duration]
        assert abs(float(np.std(logs)) - sigma) < 0.1 * sigma
        assert abs(float(np.mean(logs))) < 0.1
    pooled = [j for seed in range(4) for j in generate(_w(estimates="optimistic"), seed).jobs]
    for tenant, factor in OPTIMISM.items():
        ratios = [
            j.runtime_estimate / j.duration
            for j in pooled
            if j.queue == tenant and j.runtime_estimate and j.duration
        ]
        assert abs(float(np.median(ratios)) / factor - 1) < 0.2


def test_diurnal_notebooks_come_in_working_hours_on_weekdays() -> None:
    jobs = generate(_w(arrival="diurnal", horizon_s=WEEK), 0).jobs
    notebooks = [j for j in jobs if "-notebook-" in j.name]
    assert notebooks
    for j in notebooks:
        assert 9 <= (j.arrival % DAY) / 3600 < 18 and (j.arrival // DAY) % 7 < 5
    others = [j.arrival for j in jobs if "-research-" in j.name or "-training-" in j.name]
    weekend = sum((a // DAY) % 7 >= 5 for a in others) / len(others)
    assert 0.0 < weekend < 2 / 7  # some weekend arrivals, fewer than a uniform spread gives


def test_bursty_research_arrives_in_sweeps() -> None:
    jobs = generate(_w(arrival="bursty", mix="research"), 0).jobs
    at = Counter(j.arrival for j in jobs if "-research-" in j.name)
    assert at and set(at.values()) == {BURST}
    poisson = generate(_w(arrival="poisson", mix="research"), 0).jobs
    assert max(Counter(j.arrival for j in poisson if "-research-" in j.name).values()) < 5


def test_split_rule_is_fixed_and_balanced() -> None:
    fam = family()
    assert len(fam) == FAMILY_SIZE == 24
    assert len({w.name for w in fam}) == FAMILY_SIZE
    h = halves()
    assert tuple(w.index for w in h["tuning"]) == TUNING
    assert {w.index for w in h["evaluation"]} == set(range(FAMILY_SIZE)) - set(TUNING)
    for half in h.values():  # every factor's values appear in both halves
        assert {w.mix for w in half} == set(MIXES)
        assert {w.cluster for w in half} == set(CLUSTERS)
        assert {w.arrival for w in half} == {"poisson", "diurnal", "bursty"}
        assert {w.estimates for w in half} == {"exact", "noisy0.5", "noisy1.0", "optimistic", "missing"}
        assert {w.horizon_s for w in half} == {DAY, WEEK}
        assert min(w.load for w in half) <= 0.6 and max(w.load for w in half) >= 1.1


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="mix"):
        _w(mix="nope")
    with pytest.raises(ValueError, match="load"):
        _w(load=0)
    with pytest.raises(ValueError, match="estimates"):
        _w(estimates="noisy2")


def test_the_family_bench_refuses_a_setting_it_does_not_have_in_one_line() -> None:
    """`--set` with a configuration key spelled as in the YAML (not the field's name) stops before any
    replay, naming the fields the section has, instead of a traceback from every worker."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "queue_family.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--set", "backfill.overdueRemaining=0.5", "--workloads", "1", "--seeds", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("queue_family: --set backfill.overdueRemaining: no such setting")
    assert "overdue_remaining" in lines[0]
