"""Holds that outlive the agent, and operators' clears: two kinds of file under <stateDir>/health.

`holds.json` keeps the targets a fatal XID holds Unhealthy until the GPU is
reset, so a restart of the agent does not make a broken GPU Healthy. It
records the node's boot id (/proc/sys/kernel/random/boot_id): holds written
before a reboot are dropped when they are loaded, because a reboot resets
every GPU. The file is replaced atomically (a temporary file, fsync, rename).

`clear/<UUID>.json` is an operator's request to clear one GPU or MIG device,
written by `gpunode health clear` (request_clear) and taken by the monitor at
its next probe round (take_clears), which deletes it once applied: the
command waits for that. Each request names who cleared and why; the monitor
logs it and the Kubernetes remediator posts it as a Node Event. A request
that cannot be read is deleted with a warning. This module does file I/O only;
the verdict is gpunode.node.health.evidence's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpunode.errors import HealthStateError
from gpunode.node.files import write_atomically
from gpunode.node.health.evidence import HeldFault

log = logging.getLogger("gpunode.node.health")

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
HOLDS_FILE = "holds.json"
CLEAR_DIR = "clear"
VERSION = 1
MAX_REQUEST_BYTES = 16 * 1024
# A GPU or MIG UUID as NVML prints it; nothing else may name a file in the clear directory.
DEVICE_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z-]{0,80}")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """This boot's id (changes at every boot), or None where the kernel does not provide it."""
    try:
        return path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class ClearRequest:
    """An operator's clear of one GPU or MIG device."""

    uuid: str
    by: str
    reason: str
    at: float  # time.time() of the request


class HoldStore:
    """The health files of one state directory (see the module docstring)."""

    def __init__(self, directory: Path, *, boot_id: str | None = None) -> None:
        self.directory = Path(directory)
        self.boot_id = boot_id if boot_id is not None else read_boot_id()
        self.clear_dir = self.directory / CLEAR_DIR

    # -- holds -------------------------------------------------------------------------------------

    def load(self) -> list[HeldFault]:
        """The holds an earlier run saved in this boot; [] when there are none, they are from an earlier
        boot (logged), or the file cannot be read (logged as an error: those holds are lost)."""
        path = self.directory / HOLDS_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(
                    f"unknown format (version {data.get('version') if isinstance(data, dict) else '?'})"
                )
            holds = [_held_from_json(h) for h in data["holds"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("health: cannot read the held faults in %s (%s): they are not restored", path, exc)
            return []
        if holds and data.get("boot_id") != self.boot_id:
            log.warning(
                "health: the node rebooted since %d fault(s) were held (%s); a reboot resets the GPUs, so "
                "they are released",
                len(holds),
                ", ".join(sorted(h.target_uuid for h in holds)),
            )
            return []
        return holds

    def save(self, holds: Iterable[HeldFault]) -> None:
        """Replace the saved holds (atomically); HealthStateError when the directory cannot be written."""
        payload = {
            "version": VERSION,
            "boot_id": self.boot_id,
            "holds": [asdict(h) for h in sorted(holds, key=lambda h: h.target_uuid)],
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(
                self.directory / HOLDS_FILE, json.dumps(payload, indent=2, sort_keys=True) + "\n"
            )
        except OSError as exc:
            raise HealthStateError(f"cannot save the held faults in {self.directory}: {exc}") from None

    # -- clears ------------------------------------------------------------------------------------

    def take_clears(self, apply: Callable[[ClearRequest], None]) -> int:
        """Apply each clear request waiting, then delete it (a bad one is deleted with a warning); returns
        how many were applied. The command that wrote a request waits for it to go."""
        try:
            names = sorted(os.listdir(self.clear_dir))
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning("health: cannot list the clear requests in %s: %s", self.clear_dir, exc)
            return 0
        applied = 0
        for name in names:
            if name.startswith("."):
                continue  # a request still being written
            path = self.clear_dir / name
            try:
                request = _parse_request(path, name)
            except (OSError, ValueError) as exc:
                log.warning("health: ignoring the clear request %s: %s", path, exc)
            else:
                apply(request)
                applied += 1
            with contextlib.suppress(OSError):
                path.unlink()
        return applied


def _held_from_json(h: dict[str, Any]) -> HeldFault:
    baseline = h.get("baseline")
    if baseline is not None and not (
        isinstance(baseline, dict) and all(isinstance(v, int | float) for v in baseline.values())
    ):
        raise ValueError(f"bad baseline {baseline!r}")
    xid = h.get("xid")
    if xid is not None and (isinstance(xid, bool) or not isinstance(xid, int)):
        raise ValueError(f"bad xid {xid!r}")
    fields = {k: h[k] for k in ("target_uuid", "gpu_uuid", "kind", "reason")}
    if not all(isinstance(v, str) for v in fields.values()) or not isinstance(h.get("mig_uuid"), str | None):
        raise ValueError(f"bad entry {h!r}")
    return HeldFault(mig_uuid=h.get("mig_uuid"), xid=xid, baseline=baseline, **fields)


def _parse_request(path: Path, name: str) -> ClearRequest:
    # No links (O_NOFOLLOW), no FIFOs (O_NONBLOCK, then a regular file only), nothing large.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_REQUEST_BYTES:
            raise ValueError(f"larger than {MAX_REQUEST_BYTES} bytes")
        raw = os.read(fd, MAX_REQUEST_BYTES + 1)
    finally:
        os.close(fd)
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    uuid, by, reason, at = data.get("uuid"), data.get("by"), data.get("reason"), data.get("at")
    if not isinstance(uuid, str) or not DEVICE_UUID.fullmatch(uuid) or name != f"{uuid}.json":
        raise ValueError(f"it names no device UUID matching its file name ({uuid!r})")
    if not isinstance(by, str) or not by.strip() or not isinstance(reason, str) or not reason.strip():
        raise ValueError("it must name who cleared (by) and why (reason)")
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise ValueError(f"bad time {at!r}")
    return ClearRequest(uuid, _short(by), _short(reason), float(at))


def _short(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# -- the command's side ------------------------------------------------------------------------------


def request_clear(directory: Path, uuid: str, *, by: str, reason: str) -> Path:
    """Write a clear request for the agent using this health directory; returns its path.

    HealthStateError for a malformed UUID, an empty `by` or `reason`, or a directory that cannot be written.
    """
    if not DEVICE_UUID.fullmatch(uuid):
        raise HealthStateError(
            f"{uuid!r} is not a GPU or MIG device UUID",
            hint="name the device as `gpunode devices` shows it, e.g. GPU-5d0e3e4c-...",
        )
    if not by.strip() or not reason.strip():
        raise HealthStateError(
            "a clear must say who clears it and why", hint="pass --reason (and --by when $USER is not you)"
        )
    clear_dir = Path(directory) / CLEAR_DIR
    path = clear_dir / f"{uuid}.json"
    body = {"uuid": uuid, "by": _short(by), "reason": _short(reason), "at": time.time()}
    try:
        clear_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(body) + "\n")  # staged as a dot file, which the agent skips
    except OSError as exc:
        raise HealthStateError(f"cannot write the clear request in {clear_dir}: {exc}") from None
    return path
