"""Held-out learning curve of one head across the runs that continued it, and what more training would buy.

    python scripts/plot_heldout_curve.py --runs runs/r14/adamw runs/r14b/peagle --skip 1 \
        --tokens-per-cpu-s 120 --out docs/heads/heldout-curve

Reads every run's eval_log.jsonl (held-out accuracy per depth and the predicted mean acceptance length, written by
`peagle train --eval-every`) and train_log.jsonl (tokens per step; a resumed run may log a step twice, the last
one counts), joined in the order given. Plots accuracy at depths 1-3 and the predicted mean acceptance length at
K = 7 against training tokens seen, and fits each on a log scale (y = a + b ln tokens, from the evaluation
`--skip` on, leaving out the dip right after a restart) to say how many tokens, and CPU-hours at
`--tokens-per-cpu-s`, reaching `--target-depth2` and `--target-mal` would take if the trend held. A straight line
in log tokens is the usual shape of such curves and a rough guide, not a promise. Writes OUT.png and OUT.csv.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path


def load(run_dirs: list[str]) -> list[dict]:
    """Evaluations of every run in order, each with the training tokens seen before it (across runs)."""
    points, seen = [], 0
    for i, d in enumerate(run_dirs):
        steps: dict[int, int] = {}
        for line in (Path(d) / "train_log.jsonl").read_text().splitlines():
            r = json.loads(line)
            steps[r["step"]] = r["tokens"]
        evals = {}
        for line in (Path(d) / "eval_log.jsonl").read_text().splitlines():
            r = json.loads(line)
            evals[r["step"]] = r  # a re-run evaluation replaces the earlier one
        for step in sorted(evals):
            if i > 0 and step == 0 and points:
                continue  # the same head as the previous run's last evaluation
            r = evals[step]
            points.append({"run": i + 1, "step": step, "tokens_seen": seen + sum(t for s, t in steps.items() if s <= step),
                           "acc1": r["accuracy_per_depth"][0], "acc2": r["accuracy_per_depth"][1],
                           "acc3": r["accuracy_per_depth"][2], "mal7": r["mean_acceptance_length"]["7"]})
        seen += sum(steps.values())
    return points


def fit_log(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b ln x."""
    lx = [math.log(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def tokens_to_reach(a: float, b: float, target: float) -> float | None:
    return math.exp((target - a) / b) if b > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="`peagle train --out` folders of one head, oldest first")
    ap.add_argument("--skip", type=int, default=0, help="evaluations left out of the fit (a restart's dip)")
    ap.add_argument("--tokens-per-cpu-s", type=float, default=120.0,
                    help="training throughput to convert tokens into CPU-hours (teacher included)")
    ap.add_argument("--target-depth2", type=float, default=0.25)
    ap.add_argument("--target-mal", type=float, default=2.0)
    ap.add_argument("--out", default="docs/heads/heldout-curve")
    args = ap.parse_args()

    points = load(args.runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(points[0]))
        w.writeheader()
        w.writerows(points)

    fitted = [p for p in points[args.skip:] if p["tokens_seen"] > 0]
    xs = [p["tokens_seen"] for p in fitted]
    fits = {key: fit_log(xs, [p[key] for p in fitted]) for key in ("acc2", "mal7")}
    print(f"{len(points)} evaluations, {points[-1]['tokens_seen']:,} tokens seen; fitted on {len(fitted)}")
    for key, target, what in (("acc2", args.target_depth2, "depth-2 accuracy"),
                              ("mal7", args.target_mal, "predicted MAL at K=7")):
        a, b = fits[key]
        need = tokens_to_reach(a, b, target)
        last = points[-1]
        gain = b * math.log(2)
        hours = None if need is None else max(need - last["tokens_seen"], 0) / args.tokens_per_cpu_s / 3600
        print(f"{what}: now {last[key]:.3f}; +{gain:.3f} per doubling of tokens; {target} at "
              + ("never on this trend" if need is None else
                 f"{need / 1e6:,.1f}M tokens, {hours:,.0f} CPU-hours more at {args.tokens_per_cpu_s:g} tokens/s"))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [p["tokens_seen"] / 1e6 for p in points]
    for key, label in (("acc1", "depth 1"), ("acc2", "depth 2"), ("acc3", "depth 3")):
        ax1.plot(x, [p[key] for p in points], marker="o", label=label)
    ax1.axhline(args.target_depth2, color="grey", ls=":", lw=1, label=f"depth-2 target {args.target_depth2}")
    ax2.plot(x, [p["mal7"] for p in points], marker="o", label="measured")
    for ax, key in ((ax1, "acc2"), (ax2, "mal7")):
        a, b = fits[key]
        grid = [xs[0] * (points[-1]["tokens_seen"] * 4 / xs[0]) ** (i / 40) for i in range(41)]
        ax.plot([g / 1e6 for g in grid], [a + b * math.log(g) for g in grid], ls="--", color="black", lw=1,
                label="fit, extended to 4x the tokens" if ax is ax2 else "depth-2 fit")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
        ax.set_xlabel("training tokens seen (millions, log scale)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("held-out accuracy")
    ax2.set_ylabel("predicted mean acceptance length, K = 7")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
