"""Controlled training runs for the P-EAGLE recipe: one change at a time from a base recipe, the same data, seed and
number of steps, each measured by held-out accuracy per depth and its CPU time (docs/heads.md, "Recipe search").

    OMP_NUM_THREADS=1 python scripts/recipe_search.py --data runs/data --work runs/search --steps 100
    python scripts/recipe_search.py --work runs/search --table        # the markdown table of finished runs

`--recipe continue` measures the levers where the campaign uses them: each run continues the bundled P-EAGLE head
with the campaign's step (8 COD depths at r 0.7, frozen LM head, lr 5e-4) on conversations it has not seen, and is
evaluated on a fixed held-out set (`--eval-data`: the bundled heads' 32, scripts/split_head_data.py).

Every run shares one teacher cache (the target's outputs depend only on the data and the draft vocab), so only the
first run pays for the target's forward. A finished run (its result.json exists) is skipped, so the search resumes
where it stopped; `--only NAME ...` runs a subset (two processes can split the list).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# name -> (what changes, TrainConfig overrides)
VARIANTS = {
    "base": ("base: 2 layers, 12 depths, r 0.8, AdamW lr 1e-3, mask_hidden ~ N(0, 1)", {}),
    "mean-init": ("mask_hidden from the mean target feature (the old init)", {}),
    "norm-before-residual": ("norm_before_residual = true", {"norm_before_residual": True}),
    "frozen-lm-head": ("LM head frozen at the target's rows", {"freeze_lm_head": True}),
    "train-embeddings": ("whole embedding table trained", {"train_embeddings": True}),
    "4-layers": ("4 decoder layers", {"num_layers": 4}),
    "cod-8-0.7": ("8 COD depths, r 0.7 (speculators' defaults)", {"num_depths": 8, "cod_ratio": 0.7}),
    "cod-8-0.7-frozen": ("8 COD depths, r 0.7, LM head frozen (the cheapest step)",
                         {"num_depths": 8, "cod_ratio": 0.7, "freeze_lm_head": True}),
    "muon": ("Muon for the layers' matrices", {"optimizer": "muon"}),
    "lr-3e-3": ("learning rate 3e-3", {"lr": 3e-3}),
    "warm-eagle3": ("warm start from the bundled EAGLE-3 head", {"init_head": "smollm2-135m-eagle3"}),
    "lk-hybrid": ("loss lk_hybrid (acceptance, KL-weighted while it is low; eta 3)", {"loss": "lk_hybrid"}),
    "feature-noise": ("uniform noise +-0.1 x RMS on the target's features", {"feature_noise": 0.1}),
    "ce": ("loss ce: cross-entropy on the target's argmax (what greedy verification accepts)", {"loss": "ce"}),
}
SCRATCH = dict(method="peagle", num_layers=2, num_depths=12, draft_vocab_size=8192, batch_size=4, lr=1e-3,
               warmup_ratio=0.05, min_lr_ratio=0.1, eval_fraction=0.05, eval_samples=32, eval_depths=8, seed=0,
               save_every=0, progress=False)
# the campaign's continuation step (scripts/campaign.sh); "base" of this recipe is the campaign itself
CONTINUE = dict(SCRATCH, init_head="smollm2-135m-peagle", num_depths=8, cod_ratio=0.7, freeze_lm_head=True,
                lr=5e-4)
RECIPES = {"scratch": SCRATCH, "continue": CONTINUE}
CONTINUE_BASE = "base: the bundled P-EAGLE head continued, 8 depths, r 0.7, frozen LM head, AdamW lr 5e-4"


def run(name: str, args) -> dict:
    import torch

    from peagle.train.trainer import TrainConfig, Trainer

    _, overrides = VARIANTS[name]
    out = Path(args.work) / name
    cfg = TrainConfig(**{**RECIPES[args.recipe], "data": args.data, "out": str(out), "max_steps": args.steps,
                         "limit": args.limit, "eval_data": args.eval_data,
                         "teacher_cache": str(Path(args.work) / "teacher-cache"), **overrides})
    tr = Trainer(cfg)
    if name == "mean-init":  # what the trainer did before: the mean feature of the first training row
        ids, _ = tr._row(tr.train_rows, tr.train_ids[0])
        feats = tr.teacher(ids)[0].float()
        with torch.no_grad():
            tr.drafter.mask_hidden.copy_(feats.mean(0).reshape(1, 1, -1))
    cpu0, wall0 = time.process_time(), time.time()
    result = tr.train()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    change = CONTINUE_BASE if (args.recipe, name) == ("continue", "base") else VARIANTS[name][0]
    summary = {"name": name, "change": change, "recipe": args.recipe, "steps": result["steps"],
               "tokens": sum(m["tokens"] for m in log), "cpu_s": time.process_time() - cpu0,
               "wall_s": time.time() - wall0, "teacher_s": sum(m["teacher_seconds"] for m in log),
               "teacher_cpu_s": sum(m.get("teacher_cpu_seconds", 0.0) for m in log),
               "accuracy_per_depth": result["eval"]["accuracy_per_depth"],
               "acceptance_per_position": result["eval"]["acceptance_per_position"],
               "mean_acceptance_length": result["eval"]["mean_acceptance_length"]}
    (out / "result.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def table(work: Path) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(work.glob("*/result.json"))]
    rows.sort(key=lambda r: list(VARIANTS).index(r["name"]) if r["name"] in VARIANTS else 99)
    base = next((r for r in rows if r["name"] == "base"), None)
    # head CPU: the process's CPU less the target's forward for rows the shared teacher cache did not hold yet (the
    # first run pays for it), so rows compare what each recipe's own steps cost
    lines = ["| run | change | accuracy at depths 1, 2, 3, 4, 8 | vs base at depth 2 | predicted MAL, K=7 | "
             "CPU min | head CPU min | wall min |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        acc = r["accuracy_per_depth"]
        picks = ", ".join(f"{acc[i]:.3f}" for i in (0, 1, 2, 3, 7) if i < len(acc))
        rel = f"{acc[1] / base['accuracy_per_depth'][1]:.2f}x" if base else ""
        head = f"{(r['cpu_s'] - r['teacher_cpu_s']) / 60:.1f}" if "teacher_cpu_s" in r else ""
        lines.append(f"| {r['name']} | {r['change']} | {picks} | {rel} | {r['mean_acceptance_length']['7']:.3f} | "
                     f"{r['cpu_s'] / 60:.1f} | {head} | {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="runs/data", help="a folder from `peagle data prepare`")
    p.add_argument("--work", default="runs/search")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of 4 sequences per run")
    p.add_argument("--limit", type=int, default=500, help="conversations used (5%% held out without --eval-data)")
    p.add_argument("--recipe", choices=list(RECIPES), default="scratch",
                   help="scratch: new heads from the round-1 base; continue: the bundled P-EAGLE head continued")
    p.add_argument("--eval-data", default=None, help="a fixed held-out set (a `peagle data prepare` folder)")
    p.add_argument("--only", nargs="*", default=None, choices=list(VARIANTS))
    p.add_argument("--table", action="store_true", help="print the table of finished runs and stop")
    args = p.parse_args()
    work = Path(args.work)
    if args.table:
        print(table(work))
        return 0
    for name in args.only or list(VARIANTS):
        if (work / name / "result.json").exists():
            continue
        s = run(name, args)
        print(f"{name}: accuracy per depth {[round(a, 3) for a in s['accuracy_per_depth']]}, "
              f"{s['cpu_s'] / 60:.1f} CPU min", file=sys.stderr, flush=True)
    print(table(work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
