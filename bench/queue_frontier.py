"""Benchmark summary: the frontier of gpunode's queue settings on the workload family, beside the presets.

Each --variant is a JSON written by bench/queue_family.py for one setting of gpunode (its
--set overrides), holding the other presets' runs of the same seeds (--reuse). For each
variant and each preset this prints, over the half's workloads:

- the geometric mean of the mean wait over kai's, and of the gangs' p95 wait over kube's
  (as queue_family.py's geometric means: the waits as measured);
- the preemption losses: the mean and the largest share of delivered GPU-hours lost;
- how many workloads meet the mean-wait targets (<= 0.9 x and <= 1.1 x the better of kai and
  kueue-besteffort), the gang targets and the losses target.

and draws two panels (--png): mean wait against the largest loss, and mean wait against the
gangs' p95, a point per variant and preset. Points down and to the left are better on both;
the frontier is the variants no other beats on both.

    .venv/bin/python bench/queue_frontier.py --half tuning \\
        --variant "defaults before=bench/results/queue_frontier/before.json" ... \\
        --json bench/results/queue_frontier.json --png bench/results/queue_frontier.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

PRESETS = ("kai", "kueue-besteffort", "kube")


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else math.nan


def _wait(value: float) -> float:
    return max(value, 1e-9)  # the ratios as queue_family.py's geometric means take them


def point(doc: dict[str, Any], half: str, policy: str) -> dict[str, Any]:
    """One policy's figures over the half's workloads of one queue_family.py JSON."""
    rows = [r for r in doc["rows"] if r["half"] == half and policy in r["mean"] and "kai" in r["mean"]]
    if not rows:
        raise ValueError(f"no {half} workloads with {policy} and kai")
    mine = [r["mean"][policy] for r in rows]
    lost = [m["lost_share"] for m in mine]
    out: dict[str, Any] = {
        "workloads": len(rows),
        "mean_wait_over_kai": _geomean(
            [
                _wait(m["delay_mean"]) / _wait(r["mean"]["kai"]["delay_mean"])
                for m, r in zip(mine, rows, strict=True)
            ]
        ),
        "gang_p95_over_kube": _geomean(
            [
                _wait(m["delay_gang_p95"]) / _wait(r["mean"]["kube"]["delay_gang_p95"])
                for m, r in zip(mine, rows, strict=True)
            ]
        ),
        "lost_share_mean": statistics.fmean(lost),
        "lost_share_max": max(lost),
    }
    if policy == "gpunode":
        held = doc["halves"][half]["targets_held"]
        for key in (
            "mean_wait_0.9x_best",
            "mean_wait_1.1x_best",
            "gang_p95_0.7x_kube",
            "gang_p95_le_kai",
            "jain_0.95",
            "lost_lt_1pct",
        ):
            out[key] = held[key]
    return out


def frontier(points: dict[str, dict[str, Any]]) -> list[str]:
    """The variants no other variant beats on both mean wait and largest loss."""
    out = []
    for name, p in points.items():
        if not any(
            q["mean_wait_over_kai"] <= p["mean_wait_over_kai"]
            and q["lost_share_max"] <= p["lost_share_max"]
            and (q["mean_wait_over_kai"], q["lost_share_max"])
            != (p["mean_wait_over_kai"], p["lost_share_max"])
            for other, q in points.items()
            if other != name
        ):
            out.append(name)
    return out


def table(variants: dict[str, dict[str, Any]], presets: dict[str, dict[str, Any]]) -> str:
    head = (
        "| setting | mean wait / kai | gang p95 / kube | losses: mean | largest | mean <= 0.9x best | <= 1.1x"
        " | gang <= 0.7x kube | gang <= kai | Jain >= 0.95 | losses < 1% |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for name, p in variants.items():
        lines.append(
            f"| {name} | {p['mean_wait_over_kai']:.2f} | {p['gang_p95_over_kube']:.2f} | {100 * p['lost_share_mean']:.2f}% "
            f"| {100 * p['lost_share_max']:.2f}% | {p['mean_wait_0.9x_best']} | {p['mean_wait_1.1x_best']} "
            f"| {p['gang_p95_0.7x_kube']} | {p['gang_p95_le_kai']} | {p['jain_0.95']} | {p['lost_lt_1pct']} |"
        )
    for name, p in presets.items():
        lines.append(
            f"| preset {name} | {p['mean_wait_over_kai']:.2f} | {p['gang_p95_over_kube']:.2f} | {100 * p['lost_share_mean']:.2f}% "
            f"| {100 * p['lost_share_max']:.2f}% | | | | | | |"
        )
    return head + "\n".join(lines)


def picture(
    variants: dict[str, dict[str, Any]],
    presets: dict[str, dict[str, Any]],
    front: list[str],
    path: Path,
    half: str,
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the plot extra): no picture", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.5))
    for ax, (key, label, log) in zip(
        axes,
        (
            ("lost_share_max", "largest share of GPU-hours lost to preemption (a workload)", True),
            ("gang_p95_over_kube", "gangs' p95 wait / kube's (geometric mean)", False),
        ),
        strict=True,
    ):
        for number, (name, p) in enumerate(variants.items(), 1):
            x = max(p[key], 1e-4) if log else p[key]
            on = name in front
            ax.scatter(
                [x],
                [p["mean_wait_over_kai"]],
                s=50,
                color="tab:orange" if on else "0.55",
                zorder=3,
                label=f"{number}: {name}" if ax is axes[0] else None,
            )
            ax.annotate(
                str(number),
                (x, p["mean_wait_over_kai"]),
                fontsize=8,
                xytext=(4, 3),
                textcoords="offset points",
            )
        for name, p in presets.items():
            x = max(p[key], 1e-4) if log else p[key]
            ax.scatter(
                [x],
                [p["mean_wait_over_kai"]],
                s=70,
                marker="s",
                color={"kai": "tab:red", "kueue-besteffort": "tab:green"}.get(name, "tab:blue"),
            )
            ax.annotate(
                f"preset {name}",
                (x, p["mean_wait_over_kai"]),
                fontsize=8,
                xytext=(4, -10),
                textcoords="offset points",
            )
        if log:
            ax.set_xscale("log")
            ax.axvline(0.01, color="0.6", lw=0.8, ls="--")
        ax.axhline(0.9, color="0.6", lw=0.8, ls="--")
        ax.set_xlabel(label)
        ax.set_ylabel("mean wait / kai's (geometric mean over workloads)")
    fig.legend(loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.subplots_adjust(bottom=0.25)
    fig.suptitle(
        f"gpunode settings on the {half} half of the workload family (orange: the frontier of mean wait and losses)"
    )
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=PATH", required=True)
    parser.add_argument("--half", choices=("tuning", "evaluation"), default="tuning")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    variants: dict[str, dict[str, Any]] = {}
    presets: dict[str, dict[str, Any]] = {}
    for item in args.variant:
        label, sep, path = item.partition("=")
        if not sep:
            print(f"queue_frontier: --variant expects LABEL=PATH, got {item!r}", file=sys.stderr)
            return 2
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            variants[label] = {
                "source": path,
                "overrides": doc.get("overrides", {}),
                **point(doc, args.half, "gpunode"),
            }
            for preset in PRESETS:
                if preset not in presets:
                    presets[preset] = point(doc, args.half, preset)
        except (OSError, ValueError, KeyError) as exc:
            print(
                f"queue_frontier: {path}: {exc} (hint: give a JSON written by bench/queue_family.py)",
                file=sys.stderr,
            )
            return 2
    front = frontier(variants)
    doc = {"half": args.half, "variants": variants, "presets": presets, "frontier": front}
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    print(table(variants, presets), file=sys.stderr)
    if args.png and picture(variants, presets, front, args.png, args.half):
        print(f"picture: {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
