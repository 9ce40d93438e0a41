"""The `gpunode.idle` configuration section: when a pod's GPUs count as idle, and how often to look.

Parsed strictly with SectionReader, so a typo or a value out of range is a
ConfigError naming the key. This module only parses; the watch itself is
gpunode.node.idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.contract.reader import SectionReader

DEFAULT_BELOW_PERCENT = 5.0
DEFAULT_FOR_S = 30 * 60.0
DEFAULT_INTERVAL_S = 30.0
FOR_S = (1.0, 7 * 86400.0)  # idle.for: 1s..7d
INTERVAL_S = (0.1, 3600.0)  # idle.interval: 100ms..1h


@dataclass(frozen=True)
class IdleConfig:
    """Settings of the idle-GPU watch (gpunode.node.idle): off unless enabled."""

    enabled: bool = False
    below_percent: float = DEFAULT_BELOW_PERCENT  # utilisation under this (0 < x <= 100) counts as idle
    for_s: float = DEFAULT_FOR_S  # how long a pod's GPUs stay under it before the pod is flagged
    interval_s: float = DEFAULT_INTERVAL_S  # how often the GPUs are sampled

    @property
    def below_ratio(self) -> float:
        """The threshold as a ratio 0..1, as the backends report utilisation."""
        return self.below_percent / 100.0


def parse_idle_config(data: object, where: str) -> IdleConfig:
    """Validate the `gpunode.idle` section (a mapping; missing or null means all defaults)."""
    r = SectionReader(data, where)
    below = r.number("utilisationBelow", DEFAULT_BELOW_PERCENT, minimum=0, maximum=100)
    if below <= 0:
        raise r.fail(
            "utilisationBelow",
            "expected a percentage above 0 (no GPU is ever below 0%), got 0",
            hint="5 flags pods whose GPUs stay under 5% utilisation",
        )
    cfg = IdleConfig(
        enabled=r.flag("enabled", False),
        below_percent=below,
        for_s=r.duration("for", DEFAULT_FOR_S, minimum=FOR_S[0], maximum=FOR_S[1]),
        interval_s=r.duration("interval", DEFAULT_INTERVAL_S, minimum=INTERVAL_S[0], maximum=INTERVAL_S[1]),
    )
    r.finish()
    return cfg
