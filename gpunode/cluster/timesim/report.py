"""The time simulator's outputs: a summary per policy and load (mean over seeds), CSV rows, PNG plots.

Files under --out (name = `time-<pods>`):
- `<name>.csv`: one row per (load, policy, seed, queue) with every metric of metrics.py;
- `<name>-summary.json`: per load and policy, the mean over seeds of every metric of
  the "all" row, and the per-seed values;
- `<name>-allocation.png`: allocated GPUs (% of the cluster) over time, one line per
  policy (first seed), one panel per load;
- `<name>-wait-cdf.png`: the CDF of queueing delay per policy (all seeds), one panel per load;
- `<name>-shares.png`: each queue's share of the cluster over time, one panel per policy
  (first seed of the highest load).
The PNGs need matplotlib (the `plot` extra); without it the CSV and JSON are still written.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpunode.cluster.timesim.run import RunResult
from gpunode.errors import ConfigError


def _groups(results: Sequence[RunResult]) -> dict[tuple[float, str], list[RunResult]]:
    out: dict[tuple[float, str], list[RunResult]] = {}
    for r in results:
        out.setdefault((r.load, r.policy), []).append(r)
    return out


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


def summarize(results: Sequence[RunResult]) -> dict[str, dict[str, dict[str, object]]]:
    """{load: {policy: {"mean": {metric: mean over seeds}, "per_seed": {metric: [values]}, ...}}}."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    for (load, policy), runs in _groups(results).items():
        keys = list(runs[0].metrics["all"])
        per_seed = {k: [r.metrics["all"].get(k, float("nan")) for r in runs] for k in keys}
        queues = {
            q: {
                k: _mean([r.metrics[q].get(k, float("nan")) for r in runs])
                for k in ("delay_mean", "allocation")
            }
            for q in runs[0].queues
        }
        out.setdefault(f"{load:g}", {})[policy] = {
            "seeds": [r.seed for r in runs],
            "mean": {k: _mean(v) for k, v in per_seed.items()},
            "per_seed": per_seed,
            "queues": queues,
            "replay": {k: _mean([r.replay[k] for r in runs]) for k in runs[0].replay},
            "wall_s_per_seed": _mean([r.wall_s for r in runs]),
        }
    return out


def write_csv(results: Sequence[RunResult], path: Path) -> None:
    """One row per (load, policy, seed, queue): every metric, blank where it does not apply."""
    columns: list[str] = []
    for r in results:
        for m in r.metrics.values():
            columns.extend(k for k in m if k not in columns)
    lines = [",".join(["load", "policy", "seed", "queue", *columns])]
    for r in results:
        for queue, m in r.metrics.items():
            cells = ["" if k not in m else f"{m[k]:.6g}" for k in columns]
            lines.append(",".join([f"{r.load:g}", r.policy, str(r.seed), queue, *cells]))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_plots(results: Sequence[RunResult], paths: dict[str, Path]) -> None:
    """The three PNGs (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r.load for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    groups = _groups(results)
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4), dpi=110, squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for policy in policies:
            runs = groups.get((load, policy))
            if runs:
                r = runs[0]
                total = [100.0 * sum(h) / r.replay["cluster_gpus"] for h in r.plot_held]
                ax.plot(np.asarray(r.plot_times) / 60.0, total, label=policy, linewidth=1.3)
                ax.axvline(r.replay["horizon_s"] / 60.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"load {load:g}: GPUs allocated (seed {results[0].seed})")
        ax.set_xlabel("simulated time (min)")
        ax.set_ylabel("allocated GPUs (% of cluster)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.4)
        ax.legend(fontsize=8)
    fig.savefig(paths["allocation_png"], bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4), dpi=110, squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for policy in policies:
            runs = groups.get((load, policy), [])
            delays = np.sort(
                np.concatenate([np.asarray(r.delays, dtype=float) for r in runs] or [np.zeros(0)])
            )
            if len(delays):
                ax.plot(np.maximum(delays, 0.1), np.arange(1, len(delays) + 1) / len(delays), label=policy)
        ax.set_xscale("log")
        ax.set_title(f"load {load:g}: queueing delay CDF (all seeds)")
        ax.set_xlabel("queueing delay (s; 0 shown at 0.1)")
        ax.set_ylabel("share of jobs")
        ax.grid(alpha=0.4)
        ax.legend(fontsize=8)
    fig.savefig(paths["wait_cdf_png"], bbox_inches="tight")
    plt.close(fig)

    top = loads[-1]
    fig, axes = plt.subplots(1, len(policies), figsize=(4.5 * len(policies), 3.6), dpi=110, squeeze=False)
    for ax, policy in zip(axes[0], policies, strict=True):
        runs = groups.get((top, policy))
        if not runs:
            continue
        r = runs[0]
        held = np.asarray(r.plot_held, dtype=float).reshape(len(r.plot_times), len(r.queues))
        shares = 100.0 * held / r.replay["cluster_gpus"]
        ax.stackplot(np.asarray(r.plot_times) / 60.0, shares.T, labels=r.queues)
        ax.set_title(f"{policy}, load {top:g}")
        ax.set_xlabel("simulated time (min)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.4)
    axes[0][0].set_ylabel("share of cluster GPUs (%)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.savefig(paths["shares_png"], bbox_inches="tight")
    plt.close(fig)


def write_outputs(results: Sequence[RunResult], out_dir: Path, *, name: str) -> dict[str, Path]:
    """CSV, JSON summary and PNGs under out_dir; returns the paths written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out_dir}: cannot create the folder: {exc}") from exc
    paths = {
        "csv": out_dir / f"{name}.csv",
        "summary": out_dir / f"{name}-summary.json",
        "allocation_png": out_dir / f"{name}-allocation.png",
        "wait_cdf_png": out_dir / f"{name}-wait-cdf.png",
        "shares_png": out_dir / f"{name}-shares.png",
    }
    write_csv(results, paths["csv"])
    paths["summary"].write_text(json.dumps(summarize(results), indent=2) + "\n", encoding="utf-8")
    try:
        write_plots(results, paths)
    except ModuleNotFoundError as exc:  # matplotlib comes with the plot extra
        if not (exc.name or "").startswith("matplotlib"):
            raise
        for key in ("allocation_png", "wait_cdf_png", "shares_png"):
            del paths[key]
        print(
            "gpunode simulate: no PNG plots without matplotlib: pip install 'gpunode[plot]'", file=sys.stderr
        )
    return paths
