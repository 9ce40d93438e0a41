"""Benchmark: every queueing preset on the workload family (gpunode/cluster/timesim/family.py), both halves.

Each (workload, seed, preset) is one replay of the time simulator with the shipped
queue defaults (family.queue_config: no per-workload setting). Prints one JSON
document (also to --json) and a table per half (to stderr), and draws the
per-workload comparison (--png): one panel per metric, one point per workload and
rival preset, the rival's value across and gpunode's up (below the diagonal:
gpunode lower); evaluation workloads filled, tuning workloads hollow.

    .venv/bin/python bench/queue_family.py --seeds 0-2 --jobs 2 \\
        --json bench/results/queue_family.json --png bench/results/queue_family.png

The halves are family.SPLIT_RULE's (fixed in the family, before any tuning):
`--half tuning` runs only the tuning half. `--set section.field=value` overrides a
queue setting for every preset (tuning sweeps: e.g. --set backfill.reservations=8);
the shipped defaults are what runs without it. Nothing here asserts: read the
targets' verdicts, which follow the issue (docs/queueing.md, "Defaults"):

- mean wait <= 0.9 x the better of kai and kueue-besteffort on >= 80% of the half's
  workloads, and <= 1.1 x on every one;
- p95 wait of multi-GPU jobs and of gangs <= 0.7 x kube's and <= kai's;
- Jain's index (mean over one-day windows) >= kai's - 0.005, and >= 0.95 at load <= 0.9;
- allocation >= kube's - 0.005; idle powered GPU-hours <= kube's; no partial gang holds a
  GPU; preemption losses < 1% of the delivered GPU-hours.

Waits are compared as equal when both are under WAIT_FLOOR_S (a lightly loaded
workload's waits are the scheduler's 1 s tick, whatever the policy). Every figure is
a mean over the seeds of the workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from gpunode.cluster.queueing.config import QueueConfig
from gpunode.cluster.timesim.family import (
    SPLIT_RULE,
    Workload,
    family,
    generate,
    nodes_of,
    queue_config,
    sim_rules,
    target_workload,
)
from gpunode.cluster.timesim.run import run_replay
from gpunode.cluster.tracesim.simulate import parse_seeds

POLICIES = ("gpunode", "kai", "kueue-besteffort", "kube", "kueue-strict")
METRICS = (
    "delay_mean",
    "delay_p95",
    "delay_multi_gpu_p95",
    "delay_gang_p95",
    "jain_mean",
    "allocation",
    "idle_gpu_hours",
    "lost_share",
    "partial_gang_held_gpus",
    "not_started",
)
WAIT_FLOOR_S = 60.0
LABELS = {
    "delay_mean": "mean wait (s)",
    "delay_p95": "p95 wait (s)",
    "delay_multi_gpu_p95": "multi-GPU p95 (s)",
    "delay_gang_p95": "gang p95 (s)",
    "jain_mean": "Jain",
    "allocation": "allocation",
    "idle_gpu_hours": "idle GPU-h",
}


def with_overrides(config: QueueConfig, overrides: dict[str, Any]) -> QueueConfig:
    """The config with `section.field` (or a top-level field) replaced by each override's value."""
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        if not section:
            config = dataclasses.replace(config, **{field: value})
            continue
        inner = getattr(config, section)
        config = dataclasses.replace(config, **{section: dataclasses.replace(inner, **{field: value})})
    return config


def run_one(workload: Workload, seed: int, policy: str, overrides: dict[str, Any]) -> dict[str, Any]:
    started, cpu = time.perf_counter(), time.process_time()
    replay = generate(workload, seed)
    config = with_overrides(queue_config(workload), overrides)
    r = run_replay(
        replay,
        config=config,
        nodes=nodes_of(workload.cluster),
        workload=target_workload(replay, workload.cluster),
        policy=policy,
        seed=seed,
        load=workload.load,
        rules=sim_rules(workload),
    )
    m = r.metrics["all"]
    return {
        "workload": workload.index,
        "seed": seed,
        "policy": policy,
        "metrics": {k: float(m[k]) for k in METRICS},
        "jobs": len(replay.jobs),
        "offered_load": replay.offered_load,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,  # this process's CPU: what the replay costs on one core
    }


def _le(a: float, b: float, factor: float = 1.0) -> bool:
    """a <= factor x b for waits, both under the floor counting as equal."""
    return (a <= WAIT_FLOOR_S and b <= WAIT_FLOOR_S) or a <= factor * b


def verdicts(load: float, m: dict[str, dict[str, float]]) -> dict[str, bool]:
    """Each target of the module docstring for one workload (means over its seeds)."""
    g = m["gpunode"]
    out: dict[str, bool] = {}
    if "kai" in m and "kueue-besteffort" in m:
        best = min(m["kai"]["delay_mean"], m["kueue-besteffort"]["delay_mean"])
        out["mean_wait_0.9x_best"] = _le(g["delay_mean"], best, 0.9)
        out["mean_wait_1.1x_best"] = _le(g["delay_mean"], best, 1.1)
    for kind in ("multi_gpu", "gang"):
        key = f"delay_{kind}_p95"
        if math.isnan(g[key]):
            continue
        if "kube" in m:
            out[f"{kind}_p95_0.7x_kube"] = _le(g[key], m["kube"][key], 0.7)
        if "kai" in m:
            out[f"{kind}_p95_le_kai"] = _le(g[key], m["kai"][key])
    if "kai" in m:
        out["jain_ge_kai"] = g["jain_mean"] >= m["kai"]["jain_mean"] - 0.005
    if load <= 0.9:
        out["jain_0.95"] = g["jain_mean"] >= 0.95
    if "kube" in m:
        out["allocation_ge_kube"] = g["allocation"] >= m["kube"]["allocation"] - 0.005
        out["idle_le_kube"] = g["idle_gpu_hours"] <= m["kube"]["idle_gpu_hours"] + 1e-6
    out["no_partial_gang"] = g["partial_gang_held_gpus"] == 0
    out["lost_lt_1pct"] = g["lost_share"] < 0.01
    return out


def summarize(runs: list[dict[str, Any]], workloads: dict[int, Workload]) -> dict[str, Any]:
    per: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        per.setdefault(r["workload"], {}).setdefault(r["policy"], []).append(r)
    rows = []
    for idx in sorted(per):
        w = workloads[idx]
        means = {
            p: {k: statistics.fmean(x["metrics"][k] for x in rs) for k in METRICS}
            for p, rs in per[idx].items()
        }
        if any(
            math.isnan(v) for rs in per[idx].values() for x in rs for v in [x["metrics"]["delay_gang_p95"]]
        ):
            for p, rs in per[idx].items():  # a seed without gangs: the mean over the seeds that have some
                vals = [
                    x["metrics"]["delay_gang_p95"]
                    for x in rs
                    if not math.isnan(x["metrics"]["delay_gang_p95"])
                ]
                means[p]["delay_gang_p95"] = statistics.fmean(vals) if vals else float("nan")
        walls = [x["wall_s"] for rs in per[idx].values() for x in rs]
        any_runs = next(iter(per[idx].values()))
        rows.append(
            {
                "index": idx,
                "workload": w.name,
                "half": w.half,
                "load": w.load,
                "jobs": statistics.fmean(x["jobs"] for x in any_runs),
                "offered_load": statistics.fmean(x["offered_load"] for x in any_runs),
                "seeds": sorted(x["seed"] for x in any_runs),
                "mean": means,
                "verdicts": verdicts(w.load, means) if "gpunode" in means else {},
                "wall_s_max": max(walls),
                "wall_s_mean": statistics.fmean(walls),
            }
        )
    halves: dict[str, Any] = {}
    for half in ("tuning", "evaluation"):
        mine = [r for r in rows if r["half"] == half]
        if not mine:
            continue
        names = sorted({k for r in mine for k in r["verdicts"]})
        held = {k: sum(bool(r["verdicts"].get(k)) for r in mine if k in r["verdicts"]) for k in names}
        counted = {k: sum(k in r["verdicts"] for r in mine) for k in names}
        ratios: dict[str, dict[str, float]] = {}
        for rival in POLICIES[1:]:
            for key in LABELS:
                vals = [
                    r["mean"]["gpunode"][key] / r["mean"][rival][key]
                    for r in mine
                    if rival in r["mean"]
                    and "gpunode" in r["mean"]
                    and r["mean"][rival][key] > 0
                    and not math.isnan(r["mean"][rival][key] + r["mean"]["gpunode"][key])
                ]
                if vals:
                    ratios.setdefault(rival, {})[key] = round(
                        math.exp(statistics.fmean(math.log(max(v, 1e-9)) for v in vals)), 3
                    )
        dominance = {}
        for rival in POLICIES[1:]:
            better = worse = 0
            for r in mine:
                if rival not in r["mean"] or "gpunode" not in r["mean"]:
                    continue
                g, o = r["mean"]["gpunode"], r["mean"][rival]
                if g["delay_mean"] <= o["delay_mean"] * 1.0001 or _le(g["delay_mean"], o["delay_mean"]):
                    better += 1
                else:
                    worse += 1
            dominance[rival] = {"gpunode_mean_wait_le": better, "gpunode_mean_wait_gt": worse}
        halves[half] = {
            "workloads": len(mine),
            "targets_held": {k: f"{held[k]}/{counted[k]}" for k in names},
            "all_targets_held": sum(
                all(r["verdicts"].values())
                for r in mine
                if {"kai", "kueue-besteffort", "kube"} <= set(r["mean"])
            ),
            "geomean_ratio_gpunode_over": ratios,
            "mean_wait_dominance": dominance,
        }
    walls = [r["wall_s"] for r in runs]
    day = [r["wall_s"] for r in runs if workloads[r["workload"]].horizon_s <= 86400]
    cpu = [r["cpu_s"] for r in runs if "cpu_s" in r]
    cpu_day = [r["cpu_s"] for r in runs if "cpu_s" in r and workloads[r["workload"]].horizon_s <= 86400]
    return {
        "rows": rows,
        "halves": halves,
        "time_per_replay_s": {  # wall clock: on a shared machine it counts the waits for a core
            "all_mean": round(statistics.fmean(walls), 2) if walls else None,
            "all_max": round(max(walls), 2) if walls else None,
            "day_max": round(max(day), 2) if day else None,
            "cpu_day_max": round(max(cpu_day), 2) if cpu_day else None,
            "cpu_all_max": round(max(cpu), 2) if cpu else None,
        },
    }


def _fmt(v: float, key: str) -> str:
    if math.isnan(v):
        return "-"
    if key in ("jain_mean", "allocation"):
        return f"{v:.3f}"
    return f"{v:,.0f}"


def table(summary: dict[str, Any], policies: tuple[str, ...]) -> str:
    lines = []
    keys = tuple(LABELS)
    for half in ("tuning", "evaluation"):
        rows = [r for r in summary["rows"] if r["half"] == half]
        if not rows:
            continue
        lines.append(f"\n### {half} half\n")
        lines.append("| workload | preset | " + " | ".join(LABELS[k] for k in keys) + " | targets |")
        lines.append("|---|---|" + "---|" * (len(keys) + 1))
        for r in rows:
            for p in policies:
                if p not in r["mean"]:
                    continue
                cells = " | ".join(_fmt(r["mean"][p][k], k) for k in keys)
                held = ""
                if p == "gpunode" and r["verdicts"]:
                    failed = [k for k, ok in r["verdicts"].items() if not ok]
                    held = "all" if not failed else "missed: " + ", ".join(failed)
                lines.append(f"| {r['workload'] if p == policies[0] else ''} | {p} | {cells} | {held} |")
        h = summary["halves"].get(half, {})
        lines.append(f"\ntargets held ({half}): " + json.dumps(h.get("targets_held", {})))
    return "\n".join(lines)


def picture(summary: dict[str, Any], path: Path, policies: tuple[str, ...]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the plot extra): no picture", file=sys.stderr)
        return False
    keys = tuple(LABELS)
    fig, axes = plt.subplots(2, 4, figsize=(18, 9))
    colors = {
        "kai": "tab:red",
        "kueue-besteffort": "tab:green",
        "kube": "tab:blue",
        "kueue-strict": "tab:purple",
    }
    for ax, key in zip(axes.flat, keys, strict=False):
        lo, hi = math.inf, -math.inf
        for rival in policies:
            if rival == "gpunode":
                continue
            for half, fill in (("evaluation", True), ("tuning", False)):
                xs, ys = [], []
                for r in summary["rows"]:
                    if r["half"] != half or rival not in r["mean"] or "gpunode" not in r["mean"]:
                        continue
                    x, y = r["mean"][rival][key], r["mean"]["gpunode"][key]
                    if math.isnan(x) or math.isnan(y):
                        continue
                    if key.startswith("delay"):
                        x, y = max(x, 1.0), max(y, 1.0)
                    xs.append(x)
                    ys.append(y)
                if xs:
                    lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
                    ax.scatter(
                        xs,
                        ys,
                        s=28,
                        facecolors=colors.get(rival, "k") if fill else "none",
                        edgecolors=colors.get(rival, "k"),
                        label=f"vs {rival} ({half})",
                    )
        if lo < hi:
            ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8)
        if key.startswith("delay") or key == "idle_gpu_hours":
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(LABELS[key])
        ax.set_xlabel("rival preset")
        ax.set_ylabel("gpunode")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].axis("off")
    axes.flat[-1].legend(handles, labels, loc="center", fontsize=9)
    fig.suptitle(
        "gpunode against each preset, one point per workload (mean over seeds; below the line: gpunode lower)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--half", choices=("tuning", "evaluation", "both"), default="both")
    parser.add_argument("--workloads", help="indices to run (e.g. 0,2,4), within --half")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--reuse", type=Path, help="a previous --json: its runs of other presets are kept")
    parser.add_argument(
        "--from",
        dest="sources",
        action="append",
        default=[],
        type=Path,
        help="run nothing: summarize the runs of these --json files (later files' runs of the same "
        "workload, seed and preset replace earlier ones)",
    )
    args = parser.parse_args()
    try:
        seeds = parse_seeds(args.seeds)
    except Exception as exc:
        print(f"queue_family: {exc}", file=sys.stderr)
        return 2
    policies = tuple(p for p in args.policies.split(",") if p)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"queue_family: --set expects SECTION.FIELD=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key] = parse_value(value)
    workloads = {w.index: w for w in family()}
    config = queue_config(workloads[0])
    for key in overrides:  # a wrong name stops here, not in every worker
        section, _, field = key.rpartition(".")
        inner = getattr(config, section, None) if section else config
        names = {f.name for f in dataclasses.fields(inner)} if dataclasses.is_dataclass(inner) else set()
        if field not in names:
            where = f"{section}'s" if section else "the top level's"
            known = ", ".join(sorted(names)) if names else "none: no such section"
            print(f"queue_family: --set {key}: no such setting ({where} fields: {known})", file=sys.stderr)
            return 2
    chosen = [w for w in workloads.values() if args.half in ("both", w.half)]
    if args.workloads:
        wanted = {int(x) for x in args.workloads.split(",")}
        chosen = [w for w in chosen if w.index in wanted]
    runs: list[dict[str, Any]] = []
    if args.reuse:
        old = json.loads(args.reuse.read_text(encoding="utf-8"))
        runs = [
            r
            for r in old["runs"]
            if r["policy"] not in policies
            and r["workload"] in {w.index for w in chosen}
            and r["seed"] in seeds
        ]
    if args.sources:
        merged: dict[tuple[int, int, str], dict[str, Any]] = {}
        for path in args.sources:
            for r in json.loads(path.read_text(encoding="utf-8"))["runs"]:
                merged[(r["workload"], r["seed"], r["policy"])] = r
        runs = list(merged.values())
        seeds = tuple(sorted({r["seed"] for r in runs}))
        overrides = {
            str(path): json.loads(path.read_text(encoding="utf-8")).get("overrides", {})
            for path in args.sources
        }
    tasks = [] if args.sources else [(w, s, p) for w in chosen for s in seeds for p in policies]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run_one, w, s, p, overrides) for w, s, p in tasks]
        for n, future in enumerate(as_completed(futures), 1):
            r = future.result()
            runs.append(r)
            print(
                f"{n}/{len(tasks)} w{r['workload']:02d} seed {r['seed']} {r['policy']}: {r['wall_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if args.json and n % 10 == 0:  # what has finished so far, so a cut-short run keeps its replays
                args.json.write_text(json.dumps({"partial": True, "runs": runs}) + "\n", encoding="utf-8")
    all_policies = tuple(p for p in POLICIES if any(r["policy"] == p for r in runs))
    summary = summarize(runs, workloads)
    doc = {
        "split_rule": SPLIT_RULE,
        "seeds": list(seeds),
        "policies": list(all_policies),
        "overrides": overrides,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "processes": args.jobs},
        "wall_s": round(time.perf_counter() - started, 1),
        **summary,
        "runs": sorted(runs, key=lambda r: (r["workload"], r["policy"], r["seed"])),
    }
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    if args.png and picture(summary, args.png, all_policies):
        doc["picture"] = str(args.png)
    print(table(summary, all_policies), file=sys.stderr)
    print(
        json.dumps(
            {k: doc[k] for k in ("split_rule", "overrides", "wall_s", "halves", "time_per_replay_s")},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
