"""What preemption may cost: the work lost to preemption, kept under a share of the GPU-time delivered.

Reclaim towards the fair share (preempt.py) is the one preemption the operator did not
promise anybody: guarantees and priorities are contracts, the fair share is a target. It
buys shorter waits for queues below their share with the work its victims lose since
their last checkpoint. LossBudget lets the preemptions spend at most `share` of the
GPU-time the cluster delivers (`preemption.shareReclaim.lossBudget`) before the share
reclaim stops:

- delivered: the GPU-seconds the running jobs held, charged as time passes;
- lost: the GPU-seconds every preempted job lost (guarantee reclaim, priority and share
  reclaim alike), charged when it stops: the work since its last checkpoint (a victim
  that saved its state when told to stop loses little, one that could not loses all);
- both decay with a half-life of HALF_LIFE_S, so the budget follows the recent past: a
  quiet day does not bank losses for a later burst, and an expensive preemption is paid
  back as the cluster keeps delivering.

While the losses exceed `share` x delivered no share reclaim is started; guarantee
reclaim and priority preemption are never held back. Losses are known only when victims
stop, so the preemptions given notice within one notice period may overshoot the budget
once, by what they lose. Decay is applied on read from a reference time; delivered
GPU-time between two calls is charged at the later call, exact to one scheduling step. The
controller saves both sums with the fair-share usage (queuectl/usage.py), so a restart or a
failover does not start the budget afresh.
"""

from __future__ import annotations

import math

HALF_LIFE_S = 6 * 3600.0


class LossBudget:
    """Decayed lost and delivered GPU-seconds; see the module docstring."""

    def __init__(self, share: float, half_life_s: float = HALF_LIFE_S) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"a loss budget is a share of the GPU-time between 0 and 1, got {share}")
        self.share = share
        self._half_life = half_life_s
        self._at = 0.0  # the time both sums are expressed at
        self._lost = 0.0
        self._delivered = 0.0

    def _decay_to(self, now: float) -> None:
        if now > self._at:
            f = 2.0 ** (-(now - self._at) / self._half_life)
            self._lost *= f
            self._delivered *= f
            self._at = now

    def delivered(self, gpus: float, since: float, now: float) -> None:
        """The running jobs held `gpus` GPUs from since to now."""
        self._decay_to(now)
        if now > since and gpus > 0:
            self._delivered += gpus * (now - since)

    def lost(self, gpu_seconds: float, now: float) -> None:
        """A preempted job stopped, losing this much work."""
        self._decay_to(now)
        self._lost += max(gpu_seconds, 0.0)

    def allows(self, now: float) -> bool:
        """Whether a share reclaim may start: the losses are within the budget."""
        self._decay_to(now)
        return self._lost <= self.share * self._delivered

    def spent(self, now: float) -> float:
        """The decayed losses over the decayed delivered GPU-time (0 before anything was delivered)."""
        self._decay_to(now)
        return self._lost / self._delivered if self._delivered > 0 else 0.0

    def state(self, now: float) -> tuple[float, float]:
        """(lost, delivered) GPU-seconds decayed to `now`, to save."""
        self._decay_to(now)
        return self._lost, self._delivered

    def seed(self, lost: float, delivered: float, at: float) -> None:
        """Add sums saved by another process (or an earlier scheduler), decayed to `at`."""
        if not (math.isfinite(lost) and math.isfinite(delivered)) or lost < 0 or delivered < 0:
            raise ValueError(f"saved losses must be finite and non-negative, got {lost!r} and {delivered!r}")
        self._decay_to(at)
        f = 2.0 ** (-(self._at - at) / self._half_life)
        self._lost += lost * f
        self._delivered += delivered * f
