"""What a killed agent was writing when it died is removed when the next one starts (Preparer.recover).

A SIGKILL while a claim's region is staged leaves `<stateDir>/dra/memcap/.tmp-claim-<uid>-*`; while its
record is written, `<stateDir>/dra/claims/.<uid>.json.<pid>.tmp`. The real-kubelet version of the same
kills is tests/e2e/test_realnode_dra_restart.py; here the leftovers are laid down by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.node.dra_world import new_uid
from tests.node.test_dra_mig import MigNode


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    return int(proc.stdout)


def test_a_restarted_agent_removes_the_half_written_files_of_the_one_before(tmp_path: Path) -> None:
    node = MigNode(tmp_path)
    regions, records = node.preparer.regions_root, node.preparer.checkpoint.root
    regions.mkdir(parents=True, exist_ok=True)
    records.mkdir(parents=True, exist_ok=True)
    uid, other = new_uid(), new_uid()
    staged = regions / f".tmp-claim-{uid}-x1y2"
    staged.mkdir()
    (staged / "usage").write_bytes(b"\0" * 64)
    trash = regions / f".trash-claim-{uid}-0a0b"
    trash.mkdir()
    dead = records / f".{uid}.json.{_dead_pid()}.tmp"
    dead.write_text("{")
    another_agent = records / f".{other}.json.1.tmp"  # pid 1 is alive: another process's write in progress
    another_agent.write_text("{")
    not_ours = regions / "notes.txt"  # not a name gpunode stages under
    not_ours.write_text("kept")

    node.restart()

    assert not staged.exists() and not trash.exists() and not dead.exists()
    assert another_agent.exists() and not_ours.read_text() == "kept"
    assert sorted(p.name for p in records.iterdir()) == [another_agent.name]
