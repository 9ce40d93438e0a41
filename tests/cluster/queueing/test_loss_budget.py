"""The loss budget of reclaim towards the fair share (lossbudget.py): what it allows, what it charges, what it never holds back."""

from __future__ import annotations

import pytest

from gpunode.cluster.queueing.config import QueueConfigError
from gpunode.cluster.queueing.engine import Scheduler
from gpunode.cluster.queueing.lossbudget import HALF_LIFE_S, LossBudget
from tests.cluster.queueing.sched_helpers import TWO_TEAMS, config, job, names, scheduler


def test_the_budget_allows_share_reclaim_while_losses_stay_within_its_share_of_the_delivered_gpu_time() -> (
    None
):
    b = LossBudget(0.01, half_life_s=3600.0)
    assert b.allows(0.0) and b.spent(0.0) == 0.0  # nothing lost yet
    b.delivered(100.0, 0.0, 1000.0)  # 100 GPUs for 1000 s: 100,000 GPU-s
    b.lost(1000.0, 1000.0)
    assert b.allows(1000.0) and b.spent(1000.0) == pytest.approx(0.01)
    b.lost(0.5, 1000.0)
    assert not b.allows(1000.0)
    b.lost(-5.0, 1000.0)  # nothing is ever given back
    assert b.spent(1000.0) == pytest.approx(0.010005)


def test_losses_and_delivered_time_fade_with_the_half_life() -> None:
    b = LossBudget(0.01, half_life_s=3600.0)
    b.delivered(100.0, 0.0, 1000.0)
    b.lost(2000.0, 1000.0)  # twice the budget
    # an hour later both have halved: still over, until the cluster delivers more
    assert not b.allows(4600.0) and b.spent(4600.0) == pytest.approx(0.02)
    b.delivered(100.0, 4600.0, 5600.0)  # 100,000 GPU-s more, charged at 5600 (what was there decays first)
    f = 2 ** (-1000 / 3600)
    assert b.allows(5600.0) and b.spent(5600.0) == pytest.approx(1000.0 * f / (50_000.0 * f + 100_000.0))
    with pytest.raises(ValueError, match="between 0 and 1"):
        LossBudget(1.5)


def test_the_budget_is_read_from_the_queue_file() -> None:
    pre = {"notice": "5m", "shareReclaim": {"above": 1.0, "after": "5m", "lossBudget": 0.005}}
    assert config(TWO_TEAMS, preemption=pre).preemption.share_loss_budget == 0.005
    pre["shareReclaim"]["lossBudget"] = False
    assert config(TWO_TEAMS, preemption=pre).preemption.share_loss_budget is None
    assert config(TWO_TEAMS).preemption.share_loss_budget == 0.008  # the default
    pre["shareReclaim"]["lossBudget"] = 2
    with pytest.raises(
        QueueConfigError, match=r"preemption\.shareReclaim\.lossBudget: expected a 0\.\.1 number"
    ):
        config(TWO_TEAMS, preemption=pre)


def share_cluster(budget: float) -> Scheduler:
    """a (weight 3) and b (weight 1), no guarantees, 16 GPUs: b took all of them at t=0 while a was
    idle. At t=3600 a asks 4 GPUs: its share is 4, b's 12, so b holds 1.33 x its share."""
    reclaim = {"above": 1.25, "after": "0s", "lossBudget": budget}
    queues = [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}]
    pre = {"notice": "5m", "minRuntime": "0s", "shareReclaim": reclaim}
    s = scheduler(config(queues, preemption=pre, fairShare={"k": 0}))
    for i in range(16):
        s.submit(job(f"b{i}", "b", 1, est=100_000.0), 0.0)
    assert len(s.cycle(0.0).admit) == 16
    return s


def test_victims_charge_the_budget_with_the_work_they_lost_when_they_stop() -> None:
    s = share_cluster(0.5)
    s.submit(job("a0", "a", 4, t=3600.0, est=100.0), 3600.0)
    victims = [n.victim for n in s.cycle(3600.0).notices]
    assert len(victims) == 4 and s.loss_budget is not None and s.loss_budget.spent(3600.0) == 0.0
    for v in victims[:2]:
        s.checkpoint(v, 3700.0)  # two save their state when told to stop
    assert names(s.cycle(3900.0).admit) == ["a0"]
    f = 2 ** (-300 / HALF_LIFE_S)  # delivered: 16 GPUs to t=3600, decayed to 3900, then 16 GPUs for 300 s
    lost = 2 * 3900.0 + 2 * 200.0
    assert s.loss_budget.spent(3900.0) == pytest.approx(lost / (16 * 3600.0 * f + 16 * 300.0))


def test_a_spent_budget_holds_the_share_reclaim_back_until_the_losses_fade() -> None:
    s = share_cluster(0.01)
    assert s.loss_budget is not None
    s.cycle(3600.0)  # 57,600 GPU-s delivered
    s.loss_budget.lost(2880.0, 3600.0)  # 5% of it lost (a preemption of another queue, say)
    s.submit(job("a0", "a", 4, t=3600.0, est=100.0), 3600.0)
    for t in (3600.0, 3700.0):
        assert s.cycle(t).notices == []
    t, notices = 3700.0, []
    while not notices:  # the losses fade while b's GPUs keep delivering; the search is tried every cycle
        t += 600.0
        notices = s.cycle(t).notices
        assert (s.loss_budget.spent(t) <= 0.01) == bool(notices)
    assert 3600.0 + 3600.0 < t <= 3600.0 + 6 * 3600.0  # a few hours at 16 GPUs
    assert len(notices) == 4 and {n.reason for n in notices} == {"reclaim"}


def test_a_spent_budget_never_holds_back_a_guarantee_reclaim() -> None:
    pre = {
        "notice": "5m",
        "minRuntime": "0s",
        "shareReclaim": {"above": 1.0, "after": "0s", "lossBudget": 0.001},
    }
    s = scheduler(config(TWO_TEAMS, preemption=pre))
    for i in range(3):
        s.submit(job(f"a{i}", "a", 4, est=10_000.0), 0.0)
    assert len(s.cycle(0.0).admit) == 3  # a borrows 4 of b's guaranteed GPUs
    assert s.loss_budget is not None
    s.loss_budget.lost(1e6, 10.0)  # far over the budget
    s.submit(job("b0", "b", 8, t=10.0, est=100.0), 10.0)
    (notice,) = s.cycle(10.0).notices
    assert (notice.victim, notice.reason) == ("a2", "reclaim")


def test_the_kai_preset_reclaims_without_a_budget() -> None:
    queues = [{"name": "a"}]
    pre = {"shareReclaim": {"lossBudget": 0.01}}
    assert scheduler(config(queues, preemption=pre), policy="kai").loss_budget is None


@pytest.mark.parametrize("keep", [False, True])
def test_share_reclaim_keeps_off_a_reservation_that_starts_before_the_preemptor_ends(keep: bool) -> None:
    """b holds both nodes: 8 jobs ending by t=10000 on one, 8 running far longer on the other; c's
    8-GPU job (above c's share: no share reclaim of its own) holds the reservation on the first node
    from t=10000. a's one-GPU job, planned for 50,000 s, may share-reclaim from b: the cheapest victim
    is on the reserved node, where a would still run when c is due."""
    queues = [{"name": "a"}, {"name": "b", "weight": 2}, {"name": "c"}]  # shares then a 1, b 10, c 5 GPUs
    reclaim = {"above": 1.25, "after": "0s", "keepReservations": keep}
    s = scheduler(
        config(
            queues,
            preemption={"notice": "5m", "minRuntime": "0s", "shareReclaim": reclaim},
            fairShare={"k": 0},
        )
    )
    for i in range(8):
        s.submit(job(f"bs{i}", "b", 1, est=10_000.0), 0.0)
    for i in range(8):
        s.submit(job(f"bt{i}", "b", 1, est=100_000.0), 0.0)
    assert len(s.cycle(0.0).admit) == 16
    short_node = s.running["bs0"].plan.nodes
    assert short_node.isdisjoint(s.running["bt0"].plan.nodes)
    s.submit(job("c0", "c", 8, t=10.0, est=100.0), 10.0)
    assert s.cycle(10.0).notices == []
    reserved = s.reservation
    assert reserved is not None and reserved[0] == "c0" and reserved[1].nodes == short_node
    s.submit(job("a0", "a", 1, t=20.0, est=50_000.0), 20.0)
    (notice,) = s.cycle(20.0).notices
    assert notice.preemptor == "a0"
    assert notice.victim == ("bt0" if keep else "bs0")  # with keepReservations, off c0's node
