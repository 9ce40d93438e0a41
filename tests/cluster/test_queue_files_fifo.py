"""Files the extender and the queue controller read at run time never block their reader.

An operator's mistake or a hostile writer may put a FIFO where the queue configuration or the admission
key should be: open() of a FIFO waits for a writer, for ever. Each read must refuse it at once with its
one-line error, and the extender's re-read of a changed queue file must keep the map it had.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpunode.cluster.extender.queued import QueueNamespaces
from gpunode.cluster.queueing.config import load_queue_config
from gpunode.cluster.queuemark import load_mark_key
from gpunode.errors import AdmissionKeyError, QueueConfigError

QUEUE_FILE = """\
queues:
  - name: team-a
    guarantee: {gpu: 4}
namespaces:
  ns-a: team-a
"""
HANG_GUARD_S = 20.0  # far beyond a read that does not block; an open() of a FIFO never returns at all


def finishes(call: Callable[[], Any]) -> Any:
    """What call() returned or raised, run on a thread so that a blocked open() fails the test, not the run."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_GUARD_S)
    if worker.is_alive():
        pytest.fail("the read blocked on a FIFO (the thread stays blocked; it is a daemon)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_fifo_as_the_queue_configuration_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "queues.yaml"
    os.mkfifo(fifo)
    with pytest.raises(QueueConfigError, match=r"queues.yaml: cannot read the queue configuration: .*FIFO"):
        finishes(lambda: load_queue_config(fifo))


def test_a_fifo_as_the_admission_key_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "admission.key"
    os.mkfifo(fifo)
    with pytest.raises(AdmissionKeyError, match=r"admission.key: cannot read it: .*FIFO"):
        finishes(lambda: load_mark_key(fifo))


def test_the_extender_keeps_its_namespace_map_when_the_queue_file_becomes_a_fifo(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text(QUEUE_FILE)
    now = [0.0]
    namespaces = QueueNamespaces(path, check_every_s=1.0, clock=lambda: now[0])
    assert namespaces.get() == {"ns-a": "team-a"}
    path.unlink()
    os.mkfifo(path)
    now[0] = 5.0
    assert finishes(namespaces.get) == {"ns-a": "team-a"}
