"""Health as DRA device taints: the health engine's verdicts become taints on the slice's devices.

A fault that takes the work on the GPU down with it, and that only a reset or a replaced GPU
mends, is a `NoExecute` taint: kube-controller-manager's device-taint eviction controller then
evicts the pods whose claims hold the device, and the scheduler gives the device to no new claim.
Those faults are a fatal XID (held until the GPU is reset, gpunode.node.health.evidence), an XID
fatal to one MIG instance, an uncorrectable ECC error and a lost GPU. Every other verdict (a
counted XID over its threshold, a high single-bit ECC rate, a pending row remap or page
retirement, a failing probe) is `NoSchedule`: running pods keep the device, new claims do not
get it. The taint goes when the verdict goes, so the hold-until-reset rules of the health engine
decide when a device is offered again; nothing here keeps a clock of its own.

The taint's key is gpunode.contract.dra.TAINT_KEY, its value says what is wrong ("xid-79",
"gpu-lost", "ecc-dbe", ...), so a claim can tolerate one kind of fault and not the others.
Pure functions: the publisher (gpunode.node.dra.slices) applies them to the devices of the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpunode.config.health import XidPolicy
from gpunode.contract.dra import NO_EXECUTE, NO_SCHEDULE, TAINT_KEY
from gpunode.contract.xids import FATAL, INSTANCE_FATAL
from gpunode.node.health.evidence import Verdict
from gpunode.node.health.model import ECC_DBE, GPU_LOST, XID


@dataclass(frozen=True)
class DeviceTaint:
    """One taint for the devices of one GPU or MIG instance."""

    key: str
    value: str
    effect: str  # NO_EXECUTE | NO_SCHEDULE

    def as_json(self) -> dict[str, str]:
        """The taint as resource.k8s.io/v1 spells it (timeAdded is the API server's, or the publisher's)."""
        return {"key": self.key, "value": self.value, "effect": self.effect}


def taint_for(verdict: Verdict, xid_policy: XidPolicy) -> DeviceTaint:
    """The taint of one unhealthy target (see the module docstring for the effect)."""
    if verdict.kind == XID and verdict.xid is not None:
        value = f"xid-{verdict.xid}"
        stops = xid_policy.classify(verdict.xid) in (FATAL, INSTANCE_FATAL)
    else:
        value = verdict.kind.replace("_", "-")
        stops = verdict.kind in (GPU_LOST, ECC_DBE)
    return DeviceTaint(TAINT_KEY, value, NO_EXECUTE if stops else NO_SCHEDULE)


def device_taints(verdicts: Mapping[str, Verdict], xid_policy: XidPolicy) -> dict[str, DeviceTaint]:
    """GPU or MIG UUID -> the taint its devices carry, for every unhealthy target."""
    return {uuid: taint_for(v, xid_policy) for uuid, v in verdicts.items()}
