"""The default XID policy: which driver error codes are the application's fault and which need a GPU reset.

Each entry names the code as NVIDIA's XID catalog does (for Ampere and later
GPUs) and says why gpunode treats it the way it does. The tables are data:
gpunode.config.health builds the configurable policy from them, docs/health.md
shows them to operators, and a test checks the two agree. Nothing here reads
configuration or touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass

IGNORED, FATAL, INSTANCE_FATAL, COUNTED = "ignored", "fatal", "instance-fatal", "counted"


@dataclass(frozen=True)
class XidInfo:
    """One Xid code's catalog entry: name, handling policy and the reason for it."""

    code: int
    name: str  # the catalog's description, short
    policy: str  # IGNORED | FATAL | INSTANCE_FATAL | COUNTED
    why: str


_TABLE: tuple[XidInfo, ...] = (
    # -- the application's fault: the GPU stays healthy (the NVIDIA plugin's list, reviewed) ----
    XidInfo(13, "Graphics Engine Exception", IGNORED,
            "a user program fault (out-of-bounds access, illegal instruction); the catalog's action is "
            "to restart the application"),
    XidInfo(31, "GPU memory page fault", IGNORED,
            "an illegal address access reported by the MMU, almost always an application bug; restart "
            "the application"),
    XidInfo(43, "GPU stopped processing", IGNORED,
            "a software-induced fault in one application, which must terminate; the catalog says the GPU "
            "remains healthy"),
    XidInfo(45, "Preemptive cleanup, due to previous errors", IGNORED,
            "logged whenever the driver tears down a context (Ctrl-C, SIGKILL, reset); it follows another "
            "XID, which is judged on its own"),
    XidInfo(68, "NVDEC0 Exception", IGNORED,
            "a video decoder exception in one application's stream; restart the application"),
    # -- a GPU reset (or more) is needed: the whole GPU is marked --------------------------------
    XidInfo(46, "GPU stopped processing (timeout)", FATAL, "the catalog's immediate action is a GPU reset"),
    XidInfo(48, "Double Bit ECC Error", FATAL,
            "an uncorrectable memory error; a GPU reset or node reboot is needed to clear it"),
    XidInfo(62, "Internal micro-controller halt", FATAL, "the catalog's immediate action is a GPU reset"),
    XidInfo(64, "GPU memory remapping failure", FATAL,
            "the row remapper or page retirement failed; reset the GPU, replace it if it recurs"),
    XidInfo(74, "NVLink error", FATAL,
            "a link to a peer GPU or NVSwitch failed; a GPU reset or node reboot is needed to clear it"),
    XidInfo(79, "GPU has fallen off the bus", FATAL,
            "the GPU no longer answers on PCIe; it needs a node reboot (and often hardware service)"),
    XidInfo(95, "Uncontained memory error", FATAL,
            "a memory error that affects every application on the GPU; the GPU must be reset before "
            "applications can run again"),
    XidInfo(109, "Context switch timeout", FATAL,
            "moved out of the NVIDIA plugin's ignore list: the catalog's immediate action is a GPU reset"),
    XidInfo(110, "Security fault error", FATAL, "the catalog's immediate action is a GPU reset"),
    XidInfo(119, "GSP RPC timeout", FATAL,
            "the GPU System Processor stopped answering; a GPU reset or power cycle is needed"),
    XidInfo(120, "GSP error", FATAL,
            "an error in the GPU System Processor firmware; a GPU reset or power cycle is needed"),
    XidInfo(136, "Link training failed", FATAL, "the catalog's immediate action is a GPU reset"),
    XidInfo(140, "ECC unrecovered error", FATAL,
            "uncorrectable errors the driver could not offline or remap; reset the GPU"),
    XidInfo(143, "GPU initialization error", FATAL, "the catalog's immediate action is a GPU reset"),
    XidInfo(158, "GPU fatal timeout", FATAL, "the catalog's immediate action is a GPU reset"),
    # -- contained to one application: only the MIG instance it was reported on ------------------
    XidInfo(94, "Contained memory error", INSTANCE_FATAL,
            "contained to the application that hit it (which must restart) while other applications keep "
            "running; on a MIG GPU only that instance is marked, a reset is due when convenient"),
    # -- informational: counted like any unlisted code ----------------------------------------
    XidInfo(63, "GPU memory remapping event", COUNTED,
            "a row was marked for remapping (catalog action: ignore); the probe's pending-remap check "
            "takes the GPU out until the reset that applies it"),
    XidInfo(92, "High single-bit ECC error rate", COUNTED,
            "corrected errors (catalog action: ignore); the single-bit ECC threshold judges the rate"),
    XidInfo(154, "GPU recovery action changed", COUNTED,
            "informational, it accompanies another XID that is judged on its own"),
)  # fmt: skip

XID_TABLE: dict[int, XidInfo] = {x.code: x for x in _TABLE}

DEFAULT_IGNORED: tuple[int, ...] = tuple(x.code for x in _TABLE if x.policy == IGNORED)
DEFAULT_FATAL: tuple[int, ...] = tuple(x.code for x in _TABLE if x.policy == FATAL)
DEFAULT_INSTANCE_FATAL: tuple[int, ...] = tuple(x.code for x in _TABLE if x.policy == INSTANCE_FATAL)


def describe_xid(code: int) -> str:
    """ "XID 79 (GPU has fallen off the bus)", or "XID 200" for a code the table does not name."""
    info = XID_TABLE.get(code)
    return f"XID {code} ({info.name})" if info else f"XID {code}"
