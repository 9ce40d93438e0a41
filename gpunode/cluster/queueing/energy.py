"""GPU power per model, and the energy a schedule spends: the model behind energy-aware placement.

The model (documented in docs/queueing.md, "Placement, energy and backfill"):
- a GPU is *busy* while any pod holds any share of it; a busy GPU draws its model's
  active power (the datasheet's board power / TDP: an upper bound, as pods rarely
  run flat out);
- a node is *powered* while at least one of its GPUs is busy; its other GPUs are
  *idle on a powered node* and draw the model's idle power;
- a node with no busy GPU is *dark*: assumed powered down or in deep idle, drawing
  nothing here; its GPU-seconds are still counted (GpuSeconds.dark) so a reader can
  price them with another figure (energy_kwh's dark_w).
CPU-only pods do not power a node in this model.

POWER_TABLE's numbers: active = the NVIDIA datasheet board power of the usual server
form of each model; idle = the simulated node profiles' power_idle_w where one exists
(gpunode/node/devices/simnode/profiles: t4, a100-mig, dgx-h100), else a typical
nvidia-smi reading of an idle card of that class. G2 and G3 are the openb trace's
undisclosed Alibaba models (8-GPU nodes); they are assumed V100-class. The cluster
side does not import the node package, so the figures are repeated here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from gpunode.errors import InvalidRequest
from gpunode.placement.arrays import BoolArray, FloatArray, IntArray
from gpunode.placement.fit import model_matches

JOULES_PER_KWH = 3.6e6

# model -> (idle W, active W)
POWER_TABLE: Mapping[str, tuple[float, float]] = MappingProxyType(
    {
        "G2": (40.0, 300.0),  # undisclosed (openb); assumed V100-class
        "G3": (40.0, 300.0),  # undisclosed (openb); assumed V100-class
        "T4": (10.0, 70.0),  # datasheet 70 W; idle from simnode profile t4.yaml
        "P100": (30.0, 250.0),  # P100 PCIe datasheet 250 W
        "V100M16": (40.0, 300.0),  # V100 SXM2 16 GB datasheet 300 W
        "V100M32": (40.0, 300.0),  # V100 SXM2 32 GB datasheet 300 W
        "A10": (20.0, 150.0),  # A10 datasheet 150 W
        "A100": (60.0, 400.0),  # A100 SXM4 datasheet 400 W; idle from simnode profile a100-mig.yaml
        "H100": (70.0, 700.0),  # H100 SXM5 datasheet 700 W; idle from simnode profile dgx-h100.yaml
    }
)
FALLBACK_WATTS = (40.0, 300.0)  # a model not in the table: a V100-class card


@dataclass(frozen=True)
class PowerModel:
    """Idle and active watts per GPU model.

    A model matches a table entry by its whole name or one of its words,
    case-insensitively ("NVIDIA A100-SXM4-80GB" matches "A100"); a model matching
    no entry gets `fallback`.
    """

    table: Mapping[str, tuple[float, float]] = field(default_factory=lambda: POWER_TABLE)
    fallback: tuple[float, float] = FALLBACK_WATTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "table", MappingProxyType(dict(self.table)))
        for name, (idle, active) in (*self.table.items(), ("fallback", self.fallback)):
            if not 0 <= idle <= active:
                raise InvalidRequest(
                    f"power of {name}: need 0 <= idle ({idle} W) <= active ({active} W)",
                    hint="give each GPU model its idle and its active (board) power in watts",
                )

    def watts(self, model: str) -> tuple[float, float]:
        """(idle W, active W) of one GPU of the model."""
        exact = self.table.get(model)
        if exact is not None:
            return exact
        for name, pair in self.table.items():
            if model and model_matches(model, frozenset({name})):
                return pair
        return self.fallback


DEFAULT_POWER = PowerModel()


def extra_watts_rank(
    newly_busy: FloatArray, dark: BoolArray, gpus: IntArray, idle_w: FloatArray, active_w: FloatArray
) -> FloatArray:
    """Candidate nodes ranked 0..1 by the watts a placement adds (1: the fewest), for the energy term.

    Per node: the GPUs the placement turns busy, whether the node is dark, its GPU
    count and its model's watts. On a powered node each newly busy GPU adds active -
    idle; on a dark node a placement that makes a GPU busy powers the node up: its
    busy GPUs draw active watts and the rest idle watts. A pod that makes no GPU busy
    adds nothing.
    """
    powered_up = newly_busy * active_w + (gpus - newly_busy) * idle_w
    extra = np.where(dark, np.where(newly_busy > 0, powered_up, 0.0), newly_busy * (active_w - idle_w))
    low, high = extra.min(), extra.max()
    if high <= low:
        return np.ones(len(extra))
    ranked: FloatArray = (high - extra) / (high - low)
    return ranked


@dataclass(frozen=True)
class GpuActivity:
    """GPUs of one model at one moment: busy, idle on powered nodes, and on dark nodes."""

    busy: int
    idle_powered: int
    dark: int


@dataclass
class GpuSeconds:
    """GPU-seconds of one model: busy, idle on powered nodes, and on dark nodes."""

    busy: float = 0.0
    idle: float = 0.0
    dark: float = 0.0


def energy_kwh(
    seconds: Mapping[str, GpuSeconds], power: PowerModel = DEFAULT_POWER, *, dark_w: float = 0.0
) -> tuple[float, float]:
    """(busy kWh, idle kWh) of GPU-seconds per model; dark GPUs draw dark_w each, counted as idle."""
    busy = idle = 0.0
    for model, s in seconds.items():
        idle_w, active_w = power.watts(model)
        busy += s.busy * active_w
        idle += s.idle * idle_w + s.dark * dark_w
    return busy / JOULES_PER_KWH, idle / JOULES_PER_KWH


class EnergyMeter:
    """Integrates GPU activity over time: call observe(t, activity) after every change, in time order.

    The activity observed at t holds until the next observation (piecewise constant).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, GpuSeconds] = {}
        self._last: tuple[float, Mapping[str, GpuActivity]] | None = None

    def observe(self, t: float, activity: Mapping[str, GpuActivity]) -> None:
        """Account the previous activity up to t, then hold `activity` from t on."""
        if self._last is not None:
            t0, before = self._last
            if t < t0:
                raise InvalidRequest(f"energy meter: time went back from {t0} to {t}")
            dt = t - t0
            for model, a in before.items():
                s = self.seconds.setdefault(model, GpuSeconds())
                s.busy += a.busy * dt
                s.idle += a.idle_powered * dt
                s.dark += a.dark * dt
        self._last = (t, dict(activity))

    def kwh(self, power: PowerModel = DEFAULT_POWER, *, dark_w: float = 0.0) -> tuple[float, float]:
        """(busy kWh, idle kWh) so far (up to the last observation)."""
        return energy_kwh(self.seconds, power, dark_w=dark_w)
