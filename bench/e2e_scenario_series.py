"""The end-to-end scenario run again and again (bench/e2e_scenario.py, one run after another). Prints JSON.

    .venv/bin/python bench/e2e_scenario_series.py [--runs 30] [--out bench/results/FILE.json]
    .venv/bin/python bench/e2e_scenario_series.py --collect DIR [--out ...]   # run-N.json/.err already there

Each run's agreement (pods whose assigned, allocated and Allocate-given GPUs are the same, of the pods
compared), over-commit samples, error lines, disagreeing pods and wall time; a run that did not finish
is recorded with the last line of its error output. GPUNODE_KUBE_VERSION chooses the Kubernetes version
as for the tests (default 1.36). Run it under nice: each run starts a whole cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.controlplane import kube_version  # noqa: E402

KEPT = (
    "agreement",
    "agreement_rate",
    "disagreeing_pods",
    "overcommit_samples",
    "samples",
    "errors_in_logs",
    "error_lines",
    "wall_s",
    "filter_p99_ms",
    "prioritize_p99_ms",
    "bind_p99_ms",
)


def record(index: int, out: str, err: str) -> dict[str, Any]:
    """One run's entry from its printed JSON (or its error output when it printed none)."""
    try:
        figures = json.loads(out)
    except ValueError:
        lines = [line for line in err.splitlines() if line.strip()]
        return {"run": index, "finished": False, "failure": lines[-1][:2000] if lines else "(no output)"}
    if "skipped" in figures:
        return {"run": index, "finished": False, "failure": figures["skipped"]}
    return {"run": index, "finished": True, **{k: figures.get(k) for k in KEPT}}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in runs if r["finished"]]
    return {
        "kubernetes": kube_version(),
        "runs": len(runs),
        "finished": len(done),
        "runs_at_100_percent": sum(1 for r in done if r["agreement_rate"] == 1.0),
        "runs_below_100_percent": [r["run"] for r in done if r["agreement_rate"] != 1.0],
        "runs_with_overcommit": [r["run"] for r in done if r["overcommit_samples"]],
        "runs_with_error_lines": [r["run"] for r in done if r["errors_in_logs"]],
        "runs_not_finished": [r["run"] for r in runs if not r["finished"]],
        "per_run": runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--collect", type=Path, help="read run-N.json / run-N.err from this directory instead"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    runs = []
    if args.collect:
        n = 1
        while (args.collect / f"run-{n}.json").exists():
            out = (args.collect / f"run-{n}.json").read_text()
            err_file = args.collect / f"run-{n}.err"
            runs.append(record(n, out, err_file.read_text(errors="replace") if err_file.exists() else ""))
            n += 1
    else:
        for n in range(1, args.runs + 1):
            proc = subprocess.run(
                [sys.executable, str(ROOT / "bench" / "e2e_scenario.py")],
                capture_output=True,
                text=True,
                env=os.environ,
                check=False,
            )
            runs.append(record(n, proc.stdout, proc.stderr))
            print(json.dumps(runs[-1]), file=sys.stderr)
    text = json.dumps(summary(runs), indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
