"""state_dir/assignments.json: the pods whose GPU assignment this node carried out (gpunode.node.assignments)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from gpunode.node.files import write_atomically

log = logging.getLogger(__name__)

FILE_NAME = "assignments.json"
VERSION = 1


class CarriedOut:
    """state_dir/assignments.json: pod UID -> the GPUs it got, for the pods whose assignment was carried out.

    Written atomically; a file that cannot be read is kept aside (renamed) and reported.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILE_NAME

    def load(self) -> dict[str, list[str]]:
        """The records on disk ({} when there is no file, or it could not be read)."""
        try:
            doc = json.loads(self.path.read_text())
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError("unknown version")
            pods = doc["pods"]
            if not isinstance(pods, dict):
                raise ValueError("pods is not an object")
            return {str(k): [str(g) for g in v] for k, v in pods.items() if isinstance(v, list)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_name(f"{FILE_NAME}.corrupt")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error("assignments: %s could not be read (%s); kept as %s", self.path, exc, aside.name)
            return {}

    def save(self, records: dict[str, list[str]]) -> None:
        """Rewrite the file with `records` (temporary file, fsync, rename)."""
        write_atomically(self.path, json.dumps({"version": VERSION, "pods": records}))
