"""`gpunode doctor`: diagnose a node, one check at a time, each with a hint when it fails.

checks() returns Check records; nothing here changes the node (it opens the
backend and builds the inventory read-only, and only looks at sockets and
directories). A failed check never stops the others.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gpunode.config.agent import Config
from gpunode.errors import GpunodeError

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    """The outcome of one doctor check: status "ok", "warn" or "fail", what it found, and a hint to fix it."""

    name: str
    status: str  # ok | warn | fail
    detail: str
    hint: str = ""

    @property
    def ok(self) -> bool:
        """Whether the check did not fail (a warning counts as ok)."""
        return self.status != FAIL


def _check_python() -> Check:
    v = sys.version_info
    if v < (3, 11):
        return Check("python", FAIL, f"Python {v.major}.{v.minor}", "gpunode needs Python 3.11 or newer")
    return Check("python", OK, f"Python {v.major}.{v.minor}.{v.micro} at {sys.executable}")


def _check_backend(cfg: Config) -> Check:
    from gpunode.node.devices.select import detect_backend

    try:
        backend = detect_backend(cfg.backend, cfg.sim_profile)
    except GpunodeError as exc:
        return Check("gpu backend", FAIL, str(exc), exc.hint)
    try:
        gpus = backend.gpus()
        driver = backend.driver_version() or "unknown"
        models = sorted({g.model for g in gpus})
        mig = sum(1 for g in gpus if g.mig_enabled)
        detail = f"{backend.name}: {len(gpus)} GPU(s) {', '.join(models)}; driver {driver}"
        if mig:
            detail += f"; {mig} with MIG enabled"
        return Check("gpu backend", OK, detail)
    except GpunodeError as exc:
        return Check("gpu backend", FAIL, str(exc), exc.hint)
    finally:
        backend.close()


def _check_inventory(cfg: Config) -> Check:
    from gpunode.node.agent import Agent

    try:
        inventory = Agent(cfg).open()
    except GpunodeError as exc:
        return Check("advertised devices", FAIL, str(exc), exc.hint)
    parts = [f"{len(inventory.by_resource(r))} x {r}" for r in inventory.resources()]
    if inventory.warnings:
        return Check(
            "advertised devices", WARN, "; ".join(parts + list(inventory.warnings)), "see `gpunode devices`"
        )
    return Check("advertised devices", OK, "; ".join(parts) or "nothing")


def _socket_answers(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(path))
        return True
    except OSError:
        return False


def _check_kubelet(cfg: Config) -> Check:
    sock = cfg.kubelet_socket
    if not cfg.kubelet_dir.is_dir():
        return Check(
            "kubelet",
            WARN,
            f"{cfg.kubelet_dir} does not exist",
            "on a bare-metal node without a kubelet this is expected",
        )
    if not os.access(cfg.kubelet_dir, os.W_OK):
        return Check(
            "kubelet",
            FAIL,
            f"{cfg.kubelet_dir} is not writable",
            "run the agent as root or mount it read-write",
        )
    if not sock.exists():
        return Check("kubelet", WARN, f"no {sock}", "the agent registers as soon as the kubelet creates it")
    if not _socket_answers(sock):
        return Check("kubelet", FAIL, f"{sock} does not accept connections", "is the kubelet running?")
    ours = sorted(p.name for p in cfg.kubelet_dir.glob("gpunode-*.sock"))
    return Check(
        "kubelet", OK, f"{sock} answers; gpunode sockets: {', '.join(ours) or 'none (agent not running?)'}"
    )


def _check_pod_resources(cfg: Config) -> Check:
    sock = cfg.pod_resources_socket
    if not sock.exists():
        return Check(
            "pod-resources",
            WARN,
            f"no {sock}",
            "pod attribution in metrics and eviction need the kubelet's pod-resources API",
        )
    ok = _socket_answers(sock)
    return Check("pod-resources", OK if ok else FAIL, f"{sock} {'answers' if ok else 'does not answer'}")


def _check_state_dir(cfg: Config) -> Check:
    d = cfg.state_dir
    probe = d if d.exists() else d.parent
    if not os.access(probe, os.W_OK):
        return Check(
            "state directory",
            FAIL,
            f"{d} is not writable",
            "set --state-dir or GPUNODE_STATE_DIR to a writable path",
        )
    return Check("state directory", OK, str(d))


def _check_memcap() -> Check:
    try:
        from gpunode.node import memcap  # type: ignore[attr-defined,unused-ignore]

        lib = memcap.preload_library_path()
    except (ImportError, GpunodeError, OSError) as exc:
        return Check(
            "memory caps",
            FAIL,
            f"native parts missing: {exc}",
            "reinstall gpunode (pip install .) with a C compiler present",
        )
    return Check("memory caps", OK, f"interposer {lib}")


def checks(cfg: Config) -> list[Check]:
    """Run every check: Python, backend, advertised devices, memory caps, state dir, kubelet, pod-resources.

    A check that raises becomes a failed Check; it does not stop the others.
    """
    steps: list[Callable[[], Check]] = [
        _check_python,
        lambda: _check_backend(cfg),
        lambda: _check_inventory(cfg),
        _check_memcap,
        lambda: _check_state_dir(cfg),
        lambda: _check_kubelet(cfg),
        lambda: _check_pod_resources(cfg),
    ]
    out: list[Check] = []
    for step in steps:
        try:
            out.append(step())
        except Exception as exc:  # a broken check must not hide the others
            out.append(Check(getattr(step, "__name__", "check"), FAIL, f"check crashed: {exc!r}"))
    return out


def render(results: list[Check], *, as_json: bool = False) -> str:
    """The results as text (a line each, with a HINT line under a warning or failure), or as JSON."""
    if as_json:
        return json.dumps([asdict(c) for c in results], indent=2)
    mark = {OK: "[ ok ]", WARN: "[warn]", FAIL: "[FAIL]"}
    lines = []
    for c in results:
        lines.append(f"{mark[c.status]} {c.name}: {c.detail}")
        if c.hint and c.status != OK:
            lines.append(f"       HINT: {c.hint}")
    return "\n".join(lines)
