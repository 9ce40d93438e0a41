"""What the running agent tells `gpunode doctor` and `gpunode devices` through its state directory.

Each part that has something to say writes one small JSON file under
state_dir/status/ (atomically, only when what it says changes) and removes it
when there is nothing to say: the memory-cap clean-up that cannot run
(region-cleanup.json), the GPUs whose change of sharing mode waits for their
holders (sharing.json). The commands read them without talking to the agent.
A file that cannot be read reads as absent.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from gpunode.node.files import write_atomically

log = logging.getLogger(__name__)

DIR_NAME = "status"
CLEANUP = "region-cleanup"
SHARING = "sharing"
MAX_BYTES = 1 << 20


def status_path(state_dir: Path, name: str) -> Path:
    """The file of one status under state_dir."""
    return Path(state_dir) / DIR_NAME / f"{name}.json"


def write_status(state_dir: Path, name: str, doc: dict[str, Any] | None) -> None:
    """Say `doc` (None: nothing to say, the file is removed); a failure is logged, never raised."""
    path = status_path(state_dir, name)
    try:
        if doc is None:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(doc, indent=1, sort_keys=True))
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc.strerror or exc)


def read_status(state_dir: Path, name: str) -> dict[str, Any] | None:
    """What the agent said last under `name`, or None."""
    path = status_path(state_dir, name)
    with contextlib.suppress(OSError, ValueError):
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_BYTES))
        if isinstance(doc, dict):
            return doc
    return None


def pending_lines(state_dir: Path) -> list[str]:
    """One line per GPU whose new sharing mode waits for its holders, as the running agent said it."""
    said = read_status(state_dir, SHARING) or {}
    gpus = said.get("gpus")
    if not isinstance(gpus, list):
        return []
    lines = []
    for g in gpus:
        if not isinstance(g, dict):
            continue
        holders = g.get("holders") or []
        who = ", ".join(str(h) for h in holders[:3]) + (
            f" and {len(holders) - 3} more" if len(holders) > 3 else ""
        )
        lines.append(
            f"GPU {g.get('index')} ({g.get('uuid')}) stays {g.get('current')} until its holders are gone "
            f"({who or 'held'}), then becomes {g.get('wanted')}"
        )
    return lines
