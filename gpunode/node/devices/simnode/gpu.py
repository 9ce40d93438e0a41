"""One simulated GPU: its mutable fault state, its processes and its telemetry model.

The telemetry is a deterministic function of time and load. An idle GPU sits at
its idle power and clocks; a GPU with processes runs a slow sine-shaped
activity between 0.25 and 0.95 (scaled by the share of MIG slices in use), or
the ratio pinned by `activity_override`. Utilisation, power, temperature and
clocks follow from the activity. Energy and the NVLink byte counter are exact
integrals of it, restarted at every change of load, so they only grow and do
not depend on how often anyone samples.

SimGpu is not thread safe on its own: SimBackend (sim.py) holds its lock around
every call. This module must not import NVML.
"""

from __future__ import annotations

import math

from gpunode.node.devices.base import Gpu, GpuProbe, GpuProcess, GpuSample, MigSample
from gpunode.node.devices.simnode.profile import SimModel

ACTIVITY_PERIOD_S = 60.0
ENERGY_UPTIME_S = 86400.0  # the simulated driver was loaded a day before the backend started
NVLINK_BYTES_PER_S = 200e9  # NVLink traffic of a GPU at full activity, both directions
PCIE_TX_BYTES_PER_S = 2.0e9
PCIE_RX_BYTES_PER_S = 3.0e9
_OMEGA = 2 * math.pi / ACTIVITY_PERIOD_S


class SimGpu:
    """Mutable state of one simulated GPU."""

    def __init__(self, gpu: Gpu, model: SimModel, now: float) -> None:
        self.gpu = gpu
        self.model = model
        self.lost = False
        self.ecc_sbe = 0
        self.ecc_dbe = 0
        self.remap_correctable = 0
        self.remap_uncorrectable = 0
        self.remap_pending = False
        self.remap_failure = False
        self.retired_pages_pending = False
        self.probe_delay_s = 0.0
        self.pcie_replays = 0
        self.activity_override: float | None = None
        self.resets = 0  # GPU resets done, for `gpunode sim list`
        self.processes: dict[int, GpuProcess] = {}
        self._phase = 0.7 * gpu.index
        self._checkpoint_t = now
        self._energy_j = model.power_idle_w * ENERGY_UPTIME_S
        self._nvlink_bytes = 0.0

    # -- load ------------------------------------------------------------------------------------

    def memory_capacity_bytes(self, mig_uuid: str | None) -> int:
        """Bytes processes may use: the MIG device's total (0 if not on this GPU), else total - reserved."""
        if mig_uuid is not None:
            mig = self.gpu.mig_by_uuid(mig_uuid)
            return mig.memory_total_bytes if mig is not None else 0
        return self.model.memory_total_bytes - self.model.memory_reserved_bytes

    def memory_used_bytes(self, mig_uuid: str | None = None) -> int:
        """Bytes held by the simulated processes on the GPU, or only by those on MIG device `mig_uuid`."""
        return sum(
            p.used_memory_bytes or 0
            for p in self.processes.values()
            if mig_uuid is None or p.mig_uuid == mig_uuid
        )

    def busy_ratio(self, mig_uuid: str | None = None) -> float:
        """Share of the GPU (or of one MIG device) that has work: 0 or 1, or the busy MIG slices / 7."""
        if mig_uuid is not None:
            return 1.0 if any(p.mig_uuid == mig_uuid for p in self.processes.values()) else 0.0
        if not self.gpu.mig_enabled:
            return 1.0 if self.processes else 0.0
        busy = {p.mig_uuid for p in self.processes.values()}
        return sum(m.slices for m in self.gpu.mig_devices if m.uuid in busy) / 7.0

    def activity(self, t: float, mig_uuid: str | None = None) -> float:
        """Activity ratio 0..1 at time t, of the GPU or one MIG device.

        The override when one is set; else the busy share times a sine between 0.25 and 0.95 (period 60 s).
        """
        if self.activity_override is not None:
            return self.activity_override
        busy = self.busy_ratio(mig_uuid)
        if busy == 0.0:
            return 0.0
        return busy * (0.6 + 0.35 * math.sin(_OMEGA * t + self._phase))

    def _activity_integral(self, t0: float, t1: float) -> float:
        """Exact integral of the activity over [t0, t1], valid while the load does not change."""
        if self.activity_override is not None:
            return self.activity_override * (t1 - t0)
        busy = self.busy_ratio()
        if busy == 0.0:
            return 0.0

        def antiderivative(t: float) -> float:
            return 0.6 * t - 0.35 / _OMEGA * math.cos(_OMEGA * t + self._phase)

        return busy * (antiderivative(t1) - antiderivative(t0))

    def power_w(self, activity: float) -> float:
        """Power draw in watts at an activity ratio: idle power at 0, linearly up to 85% of the limit at 1."""
        m = self.model
        return m.power_idle_w + activity * (0.85 * m.power_limit_w - m.power_idle_w)

    def advance(self, t: float, *, linked: bool) -> None:
        """Bring energy and NVLink counters up to time t; call before every change of load."""
        t0 = self._checkpoint_t
        if t <= t0:
            return
        integral = self._activity_integral(t0, t)
        m = self.model
        self._energy_j += m.power_idle_w * (t - t0) + integral * (0.85 * m.power_limit_w - m.power_idle_w)
        if linked:
            self._nvlink_bytes += integral * NVLINK_BYTES_PER_S
        self._checkpoint_t = t

    # -- readings --------------------------------------------------------------------------------

    def sample(self, t: float, timestamp: float) -> GpuSample:
        """Telemetry at time t (advance(t) first). None where the model or the mode has no such value."""
        m = self.model
        a = self.activity(t)
        used = self.memory_used_bytes()
        has = m.supports
        profiling = has("profiling")
        remap = has("row_remapping")
        mig_mode = self.gpu.mig_enabled  # NVML gives no utilisation for a MIG-enabled GPU
        temp = m.temp_idle_c + a * (m.temp_load_c - m.temp_idle_c)
        return GpuSample(
            uuid=self.gpu.uuid,
            timestamp=timestamp,
            sm_clock_hz=m.sm_clock_max_hz if a > 0 else m.sm_clock_idle_hz,
            mem_clock_hz=m.mem_clock_hz,
            gpu_temp_c=float(round(temp)),
            memory_temp_c=float(round(temp + 4)) if has("memory_temperature") else None,
            power_w=round(self.power_w(a), 3),
            total_energy_j=round(self._energy_j, 3),
            pcie_replay_count=self.pcie_replays,
            gpu_util=None if mig_mode else round(a, 2),
            mem_copy_util=None if mig_mode else round(a * 0.45, 2),
            enc_util=0.0 if has("encoder") and not mig_mode else None,
            dec_util=0.0 if has("decoder") and not mig_mode else None,
            memory_used_bytes=used,
            memory_free_bytes=m.memory_total_bytes - m.memory_reserved_bytes - used,
            memory_reserved_bytes=m.memory_reserved_bytes,
            nvlink_bandwidth_total_bytes=int(self._nvlink_bytes) if has("nvlink") else None,
            vgpu_license_status=None,  # a simulated node is bare metal, not a vGPU guest
            remapped_rows_correctable=self.remap_correctable if remap else None,
            remapped_rows_uncorrectable=self.remap_uncorrectable if remap else None,
            row_remap_pending=self.remap_pending if remap else None,
            row_remap_failure=self.remap_failure if remap else None,
            ecc_sbe_volatile=self.ecc_sbe if has("ecc") else None,
            ecc_dbe_volatile=self.ecc_dbe if has("ecc") else None,
            gr_engine_active=round(a * 0.95, 4) if profiling else None,
            tensor_active=round(a * 0.6, 4) if profiling else None,
            dram_active=round(a * 0.5, 4) if profiling else None,
            pcie_tx_bytes_per_s=a * PCIE_TX_BYTES_PER_S if profiling else None,
            pcie_rx_bytes_per_s=a * PCIE_RX_BYTES_PER_S if profiling else None,
            mig=tuple(
                MigSample(
                    uuid=mig.uuid,
                    memory_used_bytes=self.memory_used_bytes(mig.uuid),
                    memory_total_bytes=mig.memory_total_bytes,
                    gr_engine_active=round(self.activity(t, mig.uuid) * 0.95, 4) if profiling else None,
                )
                for mig in self.gpu.mig_devices
            ),
        )

    def probe_result(self, duration_s: float) -> GpuProbe:
        """What a health probe reads from this GPU now."""
        has = self.model.supports
        if self.lost:
            return GpuProbe(
                uuid=self.gpu.uuid,
                reachable=False,
                detail="GPU is lost: it fell off the bus and needs a reset",
                duration_s=duration_s,
            )
        return GpuProbe(
            uuid=self.gpu.uuid,
            reachable=True,
            retired_pages_pending=self.retired_pages_pending if has("page_retirement") else None,
            row_remap_pending=self.remap_pending if has("row_remapping") else None,
            row_remap_failure=self.remap_failure if has("row_remapping") else None,
            ecc_sbe_volatile=self.ecc_sbe if has("ecc") else None,
            ecc_dbe_volatile=self.ecc_dbe if has("ecc") else None,
            energy_j=round(self._energy_j, 3),
            duration_s=duration_s,
        )

    def reset(self) -> None:
        """What a GPU reset does: the GPU answers again, volatile ECC counts and pending
        remaps/retired pages clear (the pending rows get remapped), its processes end, and the
        driver's energy count starts again from zero (advance() first). A remap failure stays:
        the GPU has run out of spare rows. The health monitor sees the reset in what the probe
        reads (the counters went back), exactly as it sees one on a real GPU."""
        self.resets += 1
        self._energy_j = 0.0
        self.lost = False
        self.ecc_sbe = self.ecc_dbe = 0
        self.remap_pending = False
        self.retired_pages_pending = False
        self.probe_delay_s = 0.0
        self.processes.clear()
