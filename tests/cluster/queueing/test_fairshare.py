"""Fair share: the over-quota formula on hand-worked numbers, the usage ledger's decay and window,
hierarchical division with guarantees and borrowing limits, and the admission order."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from gpunode.cluster.queueing.config import QueueConfig, parse_queue_config
from gpunode.cluster.queueing.fairshare import (
    QueueOrder,
    UsageLedger,
    dominant_share,
    fair_shares,
    over_quota_weights,
    queue_order,
    roll_up,
)
from gpunode.cluster.queueing.model import Amounts

GIB = 2**30
G = 1000  # one GPU in milli-GPU


def config(queues: list[dict[str, Any]], **extra: Any) -> QueueConfig:
    return parse_queue_config({"queues": queues, **extra}, "test.yaml")


def three_teams() -> QueueConfig:
    return config(
        [
            {
                "name": "org",
                "children": [
                    {"name": "a", "weight": 2, "guarantee": {"gpu": 2}},
                    {"name": "b", "weight": 1},
                    {"name": "c", "weight": 1},
                ],
            }
        ]
    )


def test_the_over_quota_formula_on_a_hand_worked_example() -> None:
    # Capacity 12 GPUs and 960Gi of GPU memory; a (weight 2) is guaranteed 2 GPUs, b and c (weight 1) none.
    # Demand: a 12 GPUs, b 12, c 1. Decayed usage as a dominant share (resource-seconds / capacity):
    #   a: nothing -> 0;  b: 36000 milli-GPU-s / 12000 = 3;  c: 6000 / 12000 = 0.5 GPU but 960Gi-s / 960Gi
    #   = 1 of memory, so its dominant share is 1 (dominant-resource fairness).
    # Guarantees first: a 2, b 0, c 0; 10 GPUs left. All three want more:
    #   W' = 2/4, 1/4, 1/4 = 0.5, 0.25, 0.25;  U' = 0/4, 3/4, 1/4 = 0, 0.75, 0.25
    #   P  = W' + 1 * (W' - U') = 1.0, -0.25 -> 0, 0.25;  renormalised by 1.25: 0.8, 0, 0.2
    # Water-filling the 10 GPUs: a is offered 8 of its 10, c 2 of its 1 -> c is full at 1; 9 left,
    # shared by a (0.8) and b (0): all 9 to a (it wants 10). Result: a 2+9 = 11, b 0, c 1.
    cfg = three_teams()
    capacity = {"gpu": 12 * G, "gpu_memory": 960 * GIB}
    demand = {"a": {"gpu": 12 * G}, "b": {"gpu": 12 * G}, "c": {"gpu": 1 * G}}
    usage = {"b": {"gpu": 36_000.0}, "c": {"gpu": 6_000.0, "gpu_memory": 960.0 * GIB}}
    assert over_quota_weights([2, 1, 1], [0.0, 3.0, 1.0], 1.0) == pytest.approx([0.8, 0.0, 0.2])
    shares = fair_shares(cfg, capacity, demand, usage)
    assert {q: shares[q]["gpu"] for q in "abc"} == {"a": 11 * G, "b": 0, "c": 1 * G}
    assert shares["org"] == {"gpu": 12 * G, "gpu_memory": 0}  # nobody asked for memory
    # With k = 0 usage is ignored: P = W' = 0.5, 0.25, 0.25; c is full at 1 (offered 2.5); the other 9
    # go 2:1 to a and b: a 2 + 6 = 8, b 3, c 1.
    shares = fair_shares(cfg, capacity, demand, usage, k=0.0)
    assert {q: shares[q]["gpu"] for q in "abc"} == {"a": 8 * G, "b": 3 * G, "c": 1 * G}
    # a queue clipped to P = 0 still gets what nobody else wants: a asks for 3 only, c for 1,
    # so after them the 8 GPUs left go to b (by W' among the clipped), never left idle.
    demand["a"] = {"gpu": 3 * G}
    shares = fair_shares(cfg, capacity, demand, usage)
    assert {q: shares[q]["gpu"] for q in "abc"} == {"a": 3 * G, "b": 8 * G, "c": 1 * G}


def test_over_quota_weights_edge_cases() -> None:
    # no usage at all: U' = W', so P = W'
    assert over_quota_weights([4, 3, 2, 1], [0, 0, 0, 0], 1.0) == pytest.approx([0.4, 0.3, 0.2, 0.1])
    # usage split exactly as the weights: P = W' whatever k (the fixed point)
    assert over_quota_weights([3, 1], [6.0, 2.0], 5.0) == pytest.approx([0.75, 0.25])
    # large k: only the most starved queue keeps a positive P; the P before clipping sum to 1
    assert over_quota_weights([1, 1], [1.0, 0.0], 10.0) == pytest.approx([0.0, 1.0])
    # one queue: everything
    assert over_quota_weights([7], [123.0], 3.0) == [1.0]


def test_guarantees_come_before_weights_and_a_short_pool_is_split_by_guarantee() -> None:
    cfg = config(
        [
            {"name": "x", "guarantee": {"gpu": 6}, "weight": 1},
            {"name": "y", "guarantee": {"gpu": 2}, "weight": 9},
        ]
    )
    demand = {"x": {"gpu": 100 * G}, "y": {"gpu": 100 * G}}
    # 10 GPUs: guarantees 6 + 2, then 2 left by weight 1:9 -> x 6.2, y 3.8
    shares = fair_shares(cfg, {"gpu": 10 * G}, demand, {})
    assert (shares["x"]["gpu"], shares["y"]["gpu"]) == (6200, 3800)
    # 4 GPUs: less than the 8 guaranteed, split 6:2 -> 3 and 1
    shares = fair_shares(cfg, {"gpu": 4 * G}, demand, {})
    assert (shares["x"]["gpu"], shares["y"]["gpu"]) == (3000, 1000)
    # an idle guarantee is not reserved: x wants nothing, y gets all 10
    shares = fair_shares(cfg, {"gpu": 10 * G}, {"y": {"gpu": 100 * G}}, {})
    assert (shares["x"]["gpu"], shares["y"]["gpu"]) == (0, 10 * G)


def test_borrow_limits_cap_shares_and_the_rest_goes_to_siblings() -> None:
    cfg = config(
        [
            {
                "name": "org",
                "children": [
                    {"name": "a", "guarantee": {"gpu": 2}, "borrowLimit": {"gpu": 1}, "weight": 10},
                    {"name": "b", "weight": 1},
                ],
            },
            {"name": "lab", "borrowLimit": {"gpu": 4}, "children": [{"name": "c"}]},
        ]
    )
    demand = {q: {"gpu": 100 * G} for q in "abc"}
    # 20 GPUs between org (weight 1) and lab (weight 1; may hold at most 0 + 4): lab 4, org 16;
    # inside org: a at most 2 + 1 = 3 despite its weight, b the other 13.
    shares = fair_shares(cfg, {"gpu": 20 * G}, demand, {})
    assert {q: shares[q]["gpu"] for q in cfg.queues} == {
        "org": 16 * G,
        "a": 3 * G,
        "b": 13 * G,
        "lab": 4 * G,
        "c": 4 * G,
    }


def test_usage_is_compared_among_siblings_at_each_level() -> None:
    cfg = config(
        [
            {"name": "org1", "children": [{"name": "a"}, {"name": "b"}]},
            {"name": "org2", "children": [{"name": "c"}]},
        ]
    )
    demand = {q: {"gpu": 100 * G} for q in "abc"}
    # org1 used 3 units (a 2, b 1), org2 1 unit: at the top U' = 0.75, 0.25 -> P = 0.25, 0.75 (k=1)
    # -> org1 2.5 GPUs of 10, org2 7.5; inside org1, U' = 2/3, 1/3 -> P = 1/3, 2/3 -> a 0.833, b 1.666
    usage = {"a": {"gpu": 20_000.0}, "b": {"gpu": 10_000.0}, "c": {"gpu": 10_000.0}}
    shares = fair_shares(cfg, {"gpu": 10 * G}, demand, usage)
    assert {q: shares[q]["gpu"] for q in cfg.queues} == {
        "org1": 2500,
        "a": 833,
        "b": 1666,
        "org2": 7500,
        "c": 7500,
    }


def test_dominant_share_and_roll_up() -> None:
    capacity = {"gpu": 8 * G, "gpu_memory": 640 * GIB}
    assert dominant_share({"gpu": 2 * G, "gpu_memory": 320 * GIB}, capacity) == 0.5
    assert dominant_share({"gpu": 4 * G, "gpu/T4": 1 * G}, capacity) == 0.5  # no T4 capacity: ignored
    assert dominant_share({}, capacity) == 0.0
    cfg = three_teams()
    rolled = roll_up(cfg, {"a": {"gpu": 1}, "c": {"gpu": 2, "gpu_memory": 5}, "org": {"gpu": 99}})
    assert rolled == {
        "org": {"gpu": 3, "gpu_memory": 5},
        "a": {"gpu": 1},
        "b": {},
        "c": {"gpu": 2, "gpu_memory": 5},
    }


# -- the usage ledger ----------------------------------------------------------------------------

HOUR = 3600.0


def test_usage_decays_by_half_each_half_life() -> None:
    ledger = UsageLedger(half_life_s=HOUR, window_s=24 * HOUR)
    ledger.charge("a", {"gpu": G, "gpu_memory": GIB}, 0.0, HOUR)
    # one GPU held over the last hour, weighed by 2**(-age/h): 1000 * h/ln2 * (1 - 1/2) milli-GPU-s
    expected = 1000 * HOUR / math.log(2) * 0.5
    assert ledger.usage(HOUR)["a"]["gpu"] == pytest.approx(expected, rel=1e-12)
    assert ledger.usage(2 * HOUR)["a"]["gpu"] == pytest.approx(expected / 2, rel=1e-12)
    assert ledger.usage(3 * HOUR)["a"]["gpu_memory"] == pytest.approx(GIB * HOUR / math.log(2) * 0.5 / 4)


def test_charges_in_pieces_or_out_of_order_give_the_same_usage() -> None:
    whole, pieces = UsageLedger(1800.0, 6 * HOUR), UsageLedger(1800.0, 6 * HOUR)
    whole.charge("q", {"gpu": 3 * G}, 100.0, 5000.0)
    for t0, t1 in [(2000.0, 5000.0), (100.0, 777.0), (777.0, 2000.0)]:
        pieces.charge("q", {"gpu": 3 * G}, t0, t1)
    assert pieces.usage(6000.0)["q"]["gpu"] == pytest.approx(whole.usage(6000.0)["q"]["gpu"], rel=1e-12)


def test_usage_older_than_the_window_is_forgotten() -> None:
    ledger = UsageLedger(half_life_s=10 * HOUR, window_s=HOUR)  # slow decay: only the window forgets
    ledger.charge("old", {"gpu": G}, 0.0, 60.0)
    ledger.charge("new", {"gpu": G}, 2 * HOUR, 2 * HOUR + 60.0)
    usage = ledger.usage(2 * HOUR + 60.0)
    assert "old" not in usage and usage["new"]["gpu"] > 59_000
    # a late charge for a time already outside the window is ignored too
    ledger.charge("old", {"gpu": G}, 0.0, 60.0)
    assert "old" not in ledger.usage(2 * HOUR + 60.0)


def test_the_ledger_stays_finite_over_many_half_lives() -> None:
    ledger = UsageLedger(half_life_s=60.0, window_s=600.0)
    for minute in range(0, 7 * 24 * 60, 5):  # a week of 5-minute charges: 10,000 half-lives
        ledger.charge("q", {"gpu": G}, minute * 60.0, minute * 60.0 + 300.0)
    got = ledger.usage(7 * 24 * HOUR)["q"]["gpu"]
    steady = 1000 * 60.0 / math.log(2) * (1 - 2.0**-10)  # held for the whole 600 s window
    assert math.isfinite(got) and got == pytest.approx(steady, rel=1e-3)


def test_the_ledger_refuses_bad_times() -> None:
    ledger = UsageLedger(HOUR, 24 * HOUR)
    with pytest.raises(ValueError, match="expected finite t0 <= t1"):
        ledger.charge("q", {"gpu": G}, 10.0, 5.0)
    with pytest.raises(ValueError, match="expected finite t0 <= t1"):
        ledger.charge("q", {"gpu": G}, 0.0, math.inf)
    ledger.charge("q", {"gpu": G}, 0.0, 100.0)
    with pytest.raises(ValueError, match="before the end of a charge"):
        ledger.usage(50.0)
    with pytest.raises(ValueError, match="must be positive"):
        UsageLedger(0.0, HOUR)


def test_ledger_usage_rolls_up_with_a_config() -> None:
    cfg = three_teams()
    ledger = UsageLedger.from_settings(cfg.fair_share)
    ledger.charge("a", {"gpu": G}, 0.0, 10.0)
    ledger.charge("b", {"gpu": G}, 0.0, 10.0)
    usage = ledger.usage(10.0, cfg)
    assert usage["org"]["gpu"] == pytest.approx(usage["a"]["gpu"] + usage["b"]["gpu"]) and usage["c"] == {}


# -- the admission order -------------------------------------------------------------------------


def test_queues_below_their_guarantee_come_first_then_the_lowest_ratio() -> None:
    cfg = config(
        [
            {
                "name": "org",
                "children": [
                    {"name": "a", "guarantee": {"gpu": 2}},
                    {"name": "b"},
                    {"name": "c"},
                    {"name": "d"},
                ],
            }
        ]
    )
    shares: dict[str, Amounts] = {
        "a": {"gpu": 2 * G},
        "b": {"gpu": 4 * G},
        "c": {"gpu": 4 * G},
        "d": {"gpu": 0},
    }
    allocated = {"a": {"gpu": 1 * G}, "b": {"gpu": 3 * G}, "c": {"gpu": 1 * G}, "d": {"gpu": 500}}
    # a is below its guarantee (1 of 2); then c (1/4) before b (3/4); d holds GPUs it has no share of
    assert queue_order(cfg, allocated, shares) == ["a", "c", "b", "d"]
    # at its guarantee a competes by ratio: 2/2 = 1 > 3/4
    allocated["a"] = {"gpu": 2 * G}
    assert queue_order(cfg, allocated, shares) == ["c", "b", "a", "d"]
    # ties are broken by name; `among` restricts the order to queues with pending jobs
    allocated["b"] = {"gpu": 1 * G}
    assert queue_order(cfg, allocated, shares, among=["d", "c", "b", "nope"]) == ["b", "c", "d"]


def test_the_order_is_hierarchical() -> None:
    cfg = config(
        [{"name": "org1", "children": [{"name": "a"}]}, {"name": "org2", "children": [{"name": "b"}]}]
    )
    shares: dict[str, Amounts] = {
        "org1": {"gpu": 2 * G},
        "a": {"gpu": 2 * G},
        "org2": {"gpu": 8 * G},
        "b": {"gpu": 8 * G},
    }
    assert queue_order(cfg, {"a": {"gpu": 1 * G}, "b": {"gpu": 6 * G}}, shares) == ["a", "b"]  # 0.5 < 0.75
    assert queue_order(cfg, {"a": {"gpu": 2 * G}, "b": {"gpu": 6 * G}}, shares) == ["b", "a"]  # 1 > 0.75


def test_incremental_order_matches_a_fresh_one() -> None:
    cfg = config(
        [
            {
                "name": f"org{i}",
                "guarantee": {"gpu": i},
                "children": [{"name": f"t{i}{j}", "weight": j + 1} for j in range(4)],
            }
            for i in range(5)
        ]
    )
    rng = random.Random(14)
    capacity = {"gpu": 64 * G, "gpu_memory": 64 * 80 * GIB}
    demand = {
        q: {"gpu": rng.randrange(0, 20) * G, "gpu_memory": rng.randrange(0, 900) * GIB} for q in cfg.leaves
    }
    shares = fair_shares(cfg, capacity, demand, {})
    allocated: dict[str, Amounts] = {q: {} for q in cfg.leaves}
    order = QueueOrder(cfg, shares, allocated)
    for _ in range(300):
        leaf = rng.choice(cfg.leaves)
        delta = {
            "gpu": rng.choice([-1, 1]) * rng.randrange(0, 4) * 500,
            "gpu_memory": rng.randrange(-40, 41) * GIB,
        }
        allocated[leaf] = {r: allocated[leaf].get(r, 0) + v for r, v in delta.items()}
        if rng.random() < 0.5:
            order.charge(leaf, delta)
        else:
            order.set_allocation(leaf, allocated[leaf])
        assert order.order() == queue_order(cfg, allocated, shares)


# -- properties of the division on random trees --------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RESOURCES = ("gpu", "gpu_memory")


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[QueueConfig, Amounts, dict[str, Amounts], dict[str, dict[str, float]], float]:
    queues: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 3))):
        children = []
        for j in range(draw(st.integers(0, 4))):
            child: dict[str, Any] = {"name": f"q{i}{j}", "weight": draw(st.sampled_from([0.5, 1, 2, 3, 7]))}
            if draw(st.booleans()):
                child["guarantee"] = {
                    "gpu": draw(st.integers(0, 8)),
                    "gpu_memory": draw(st.integers(0, 8)) * GIB,
                }
            if draw(st.booleans()):
                child["borrowLimit"] = {"gpu": draw(st.integers(0, 8))}
            children.append(child)
        root: dict[str, Any] = {"name": f"r{i}", "weight": draw(st.sampled_from([1, 2, 5]))}
        if children:
            root["children"] = children
        elif draw(st.booleans()):
            root["guarantee"] = {"gpu": draw(st.integers(0, 8))}
        queues.append(root)
    cfg = config(queues)
    capacity = {"gpu": draw(st.integers(0, 40)) * G, "gpu_memory": draw(st.integers(0, 40)) * GIB}
    demand = {
        q: {"gpu": draw(st.integers(0, 30)) * 250, "gpu_memory": draw(st.integers(0, 30)) * GIB // 2}
        for q in cfg.leaves
    }
    usage = {q: {"gpu": float(draw(st.integers(0, 10**6)))} for q in cfg.leaves if draw(st.booleans())}
    return cfg, capacity, demand, usage, draw(st.sampled_from([0.0, 0.5, 1.0, 3.0]))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_shares_are_bounded_conserving_and_honour_guarantees(
    scenario: tuple[QueueConfig, Amounts, dict[str, Amounts], dict[str, dict[str, float]], float],
) -> None:
    cfg, capacity, demand, usage, k = scenario
    shares = fair_shares(cfg, capacity, demand, usage, k=k)
    slack = len(cfg.queues)  # rounding down loses less than one unit per queue
    rolled = roll_up(cfg, demand)
    capped: dict[str, dict[str, float]] = {}
    for name in reversed(list(cfg.queues)):
        spec = cfg.queues[name]
        want = (
            dict(rolled[name])
            if spec.leaf
            else {r: sum(capped[c][r] for c in spec.children) for r in RESOURCES}
        )
        limit = cfg.limit(name) or {}
        capped[name] = {r: min(want.get(r, 0), limit.get(r, math.inf)) for r in RESOURCES}
    for r in RESOURCES:
        roots = cfg.root_names
        given_out = sum(shares[q][r] for q in roots)
        # never more than the capacity; all of it when the queues can use it (work-conserving)
        assert given_out <= capacity[r]
        assert given_out >= min(capacity[r], sum(capped[q][r] for q in roots)) - slack
        guaranteed = sum(min(cfg.queues[q].guarantee.get(r, 0), capped[q][r]) for q in roots)
        for name, spec in cfg.queues.items():
            assert shares[name][r] <= capped[name][r] + 1e-6  # nobody gets more than it can use
            if spec.children:
                assert sum(shares[c][r] for c in spec.children) <= shares[name][r]
                assert sum(shares[c][r] for c in spec.children) >= shares[name][r] - slack
            if (
                guaranteed <= capacity[r]
            ):  # the promises fit: everyone gets its guarantee (as far as it wants)
                assert shares[name][r] >= min(spec.guarantee.get(r, 0), capped[name][r]) - slack
