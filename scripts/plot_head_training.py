"""Learning curves of the bundled heads: training accuracy per draft position against tokens seen.

    python scripts/plot_head_training.py --peagle runs/heads/peagle runs/heads2/peagle \
        --eagle3 runs/heads/eagle3 runs/heads2/eagle3 --out docs/heads/training

Each head may have been trained in several runs (the later ones continue with --init-head); their train_log.jsonl
files are joined in the order given. Writes OUT.png and OUT.csv (per step: run, tokens seen, loss, accuracy at the
first three positions), the figures docs/heads.md quotes.
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

POSITIONS = 3  # positions plotted: later ones are near zero for heads this young
WINDOW = 20  # steps in the moving average (single steps are noisy: 1-2K tokens each)


def load_runs(run_dirs: list[str]) -> list[dict]:
    """Steps of every run, in order, with the tokens seen so far across runs."""
    rows, seen = [], 0
    for i, d in enumerate(run_dirs):
        path = Path(d) / "train_log.jsonl"
        if not path.exists():
            raise SystemExit(f"{path} not found: pass the output folders of `peagle train` (--out)")
        for line in path.read_text().splitlines():
            r = json.loads(line)
            seen += r["tokens"]
            rows.append({"run": i + 1, "step": r["step"], "tokens_seen": seen, "loss": round(r["loss"], 4),
                         **{f"acc{p + 1}": round(r["acc"][p], 4) for p in range(min(POSITIONS, len(r["acc"])))}})
    return rows


def moving_average(xs: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peagle", nargs="+", required=True, help="P-EAGLE training folders, oldest first")
    ap.add_argument("--eagle3", nargs="+", required=True, help="EAGLE-3 training folders, oldest first")
    ap.add_argument("--out", default="docs/heads/training")
    args = ap.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = {"P-EAGLE": load_runs(args.peagle), "EAGLE-3": load_runs(args.eagle3)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        fields = ["head", "run", "step", "tokens_seen", "loss"] + [f"acc{p + 1}" for p in range(POSITIONS)]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for name, rows in heads.items():
            w.writerows({"head": name, **r} for r in rows)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (name, rows) in zip(axes, heads.items()):
        x = [r["tokens_seen"] / 1e6 for r in rows]
        for p in range(POSITIONS):
            ax.plot(x, moving_average([r[f"acc{p + 1}"] for r in rows], WINDOW), label=f"position {p + 1}")
        for a, b in zip(rows, rows[1:]):
            if b["run"] != a["run"]:
                ax.axvline(a["tokens_seen"] / 1e6, color="grey", ls=":", lw=1)
        ax.set_title(f"{name} (dotted: a new run continues the head)")
        ax.set_xlabel("training tokens seen (millions)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"training accuracy ({WINDOW}-step moving average)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    for name, rows in heads.items():
        last = rows[-WINDOW:]
        accs = ", ".join(f"{sum(r[f'acc{p + 1}'] for r in last) / len(last):.3f}" for p in range(POSITIONS))
        print(f"{name}: {len(rows)} steps, {rows[-1]['tokens_seen']:,} tokens; accuracy per position over the "
              f"last {len(last)} steps: {accs}")
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
