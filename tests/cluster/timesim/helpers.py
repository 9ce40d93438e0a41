"""Tiny openb-format traces written by the tests, so every number can be checked by hand."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

NODE_HEADER = ["sn", "cpu_milli", "memory_mib", "gpu", "model"]
POD_HEADER = [
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
]


def pod(
    name: str, gpus: int, created: float | str, deleted: float, scheduled: float | None, *, qos: str = "LS"
) -> list[object]:
    """One pod row: whole GPUs (0: a CPU pod), 4 cores, 8 GiB."""
    return [
        name,
        4000,
        8192,
        gpus,
        1000 if gpus else 0,
        "",
        qos,
        "Running" if scheduled is not None else "Pending",
        created,
        deleted,
        "" if scheduled is None else scheduled,
    ]


def write_trace(folder: Path, pods: Sequence[Sequence[object]], *, nodes: Sequence[tuple[str, int]]) -> Path:
    """folder/csv/ with a node list (name, GPUs; V100M16, 64 cores) and the pod list `default`."""
    csv_dir = folder / "csv"
    csv_dir.mkdir(parents=True, exist_ok=True)
    with (csv_dir / "openb_node_list_gpu_node.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(NODE_HEADER)
        for name, gpus in nodes:
            w.writerow([name, 64000, 262144, gpus, "V100M16"])
    with (csv_dir / "openb_pod_list_default.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(POD_HEADER)
        w.writerows(pods)
    return folder


QUEUES_YAML = """
queues:
  - name: org
    children:
      - {name: team-a, weight: 1}
      - {name: team-b, weight: 1}
preemption: {notice: 5m, minRuntime: 10m}
energy: {weight: 0.0}
placement: {policy: bestfit}
"""
