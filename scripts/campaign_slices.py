"""The campaign's benchmark slice: the first few HumanEval and MT-Bench prompts, measured by the engine (real
speculative decoding, greedy, its own counters) on the bundled heads and on every EVERY-th checkpoint the campaign
writes, so that the learning curve in docs/heads.md shows benchmark acceptance as training goes, not only the
held-out conversations. Cheap enough to run beside training: a few CPU-minutes per head and checkpoint.

    python3 scripts/campaign_slices.py --work runs/campaign --watch    # scripts/campaign.sh runs this beside training
    python3 scripts/campaign_slices.py --work runs/campaign            # measure what is pending once, print the table
    python3 scripts/campaign_slices.py --work runs/campaign --rounds runs/campaign/rounds --watch   # every round

A round (a folder under --rounds, or --work given again) continues a bundled head, whose step 0 the first --work
measures once; each round's folder holds its own checkpoints and slices. With --rounds, --watch goes on until it is
stopped (scripts/campaign.sh stops it when its rounds end), looking for new rounds as they start.

A checkpoint's head is copied to WORK/slices/heads/ before it is measured (the trainer prunes old checkpoints), and
every result is appended to WORK/slices/results.jsonl as it finishes: a killed run measures only what is missing.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
SLICE = {"humaneval": 16, "mtbench": 16}  # first N prompts of each set: fixed, so every row compares
K = 7
MAX_TOKENS = 128
EVERY = 200           # steps between measured checkpoints
SETTLE_SECONDS = 60   # a checkpoint's head is read only once its files have stopped changing
POLL_SECONDS = 120
METHODS = ("peagle", "eagle3")

Measure = Callable[[str, str, str], dict]  # (method, dataset, head folder) -> benchmarks/acceptance.py's run


def records(path: Path) -> list[dict]:
    """A JSONL file's records; a line cut short by a kill is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def tokens_seen(run: Path, step: int) -> int:
    """Training tokens up to `step`, from the run's train_log.jsonl (the last record of a step counts: a resumed run
    repeats the steps after its checkpoint)."""
    per_step = {rec["step"]: rec["tokens"] for rec in records(run / "train_log.jsonl")}
    return sum(t for s, t in per_step.items() if s <= step)


def final_step(run: Path) -> int | None:
    """The step a finished run stopped at, or None while it trains (the trainer writes training_args.json last)."""
    if not (run / "training_args.json").exists():
        return None
    cks = [int(p.name.split("-")[1]) for p in run.glob("checkpoint-*")]
    return max(cks) if cks else 0


def candidates(work: Path, every: int, bundled: bool = True) -> Iterator[tuple[str, int, Path]]:
    """(method, step, head folder) of everything the slice should measure: the bundled head as step 0 (when the
    round starts from it), each `every`-th checkpoint, and the finished head."""
    from peagle.model.heads import resolve_head

    for method in METHODS:
        if bundled:
            yield method, 0, resolve_head(None, method=method)
        run = work / method
        for ck in sorted(run.glob("checkpoint-*/head"), key=lambda p: int(p.parent.name.split("-")[1])):
            step = int(ck.parent.name.split("-")[1])
            if step % every == 0 and settled(ck):
                yield method, step, ck
        last = final_step(run)
        if last is not None:
            yield method, last, run


def settled(head: Path) -> bool:
    """Whether a checkpoint's head has been written completely: files present and unchanged for SETTLE_SECONDS."""
    try:
        times = [f.stat().st_mtime for f in head.iterdir()]
    except OSError:  # pruned by the trainer meanwhile
        return False
    return bool(times) and time.time() - max(times) > SETTLE_SECONDS


def measured(results: Path) -> set[tuple[str, int, str]]:
    return {(r["method"], r["step"], r["dataset"]) for r in records(results)}


def keep_copy(head: Path, copy: Path) -> Path:
    """A private copy of a head the trainer may prune, made under a temporary name and renamed when complete (a
    copy cut short by a kill is never measured)."""
    if not copy.exists():
        tmp = copy.with_name(copy.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(head, tmp, ignore=shutil.ignore_patterns("checkpoint-*", "*.pt", "*.jsonl"))
        tmp.rename(copy)
    return copy


def engine_measure(method: str, dataset: str, head: str) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from acceptance import run_one

    return run_one(method, K, dataset, head, SLICE[dataset], MAX_TOKENS, max_num_seqs=16, threads=1)


def measure_pending(work: Path, every: int = EVERY, measure: Measure = engine_measure, bundled: bool = True) -> int:
    """Measure every candidate not yet in WORK/slices/results.jsonl; returns how many runs it made."""
    out = work / "slices"
    (out / "heads").mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done, made, jobs = measured(results), 0, {}
    for method, step, head in candidates(work, every, bundled):
        todo = [ds for ds in SLICE if (method, step, ds) not in done]
        if not todo or (method, step) in jobs:  # the finished head may also be an EVERY-th checkpoint
            continue
        try:  # copies first, all of them: measuring takes minutes, and the trainer prunes checkpoints meanwhile
            jobs[method, step] = (keep_copy(head, out / "heads" / f"{method}-{step}") if step > 0 else head, todo)
        except OSError as e:
            print(f"slice {method} step {step}: could not copy {head} ({e}); skipped", flush=True)
    for (method, step), (head, todo) in jobs.items():
        tokens = tokens_seen(work / method, step)
        for ds in todo:
            try:
                r = measure(method, ds, str(head))
            except Exception:  # logged and tried again at the next poll; the other heads are still measured
                print(f"slice {method} step {step} {ds}: failed\n{traceback.format_exc()}", flush=True)
                continue
            row = {"method": method, "step": step, "tokens_seen": tokens, "dataset": ds,
                   "head": str(head), "k": K, **{k: r[k] for k in ("prompts", "max_tokens", "mean_acceptance_length",
                                                                   "acceptance_per_position", "output_tokens",
                                                                   "outputs_sha256", "seconds")}}
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            made += 1
            print(f"slice {method} step {step} ({row['tokens_seen']:,} training tokens) {ds}: mean acceptance length "
                  f"{row['mean_acceptance_length']:.3f} at K={K}, per position "
                  f"{[round(a, 3) for a in row['acceptance_per_position'][:3]]} ({row['seconds']} s)", flush=True)
    return made


def table(work: Path) -> str:
    """The learning curve's benchmark columns, as markdown."""
    results = work / "slices" / "results.jsonl"
    rows = records(results)
    by: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        by.setdefault((r["method"], r["step"]), {})[r["dataset"]] = r
    lines = [f"| head | step | training tokens | " + " | ".join(
                 f"{ds} ({n} prompts) MAL K={K}, positions 1-2" for ds, n in SLICE.items()) + " |",
             "|---|---:|---:|" + "---|" * len(SLICE)]
    for (method, step), cells in sorted(by.items()):
        tokens = next(iter(cells.values()))["tokens_seen"]
        lines.append(f"| {'P-EAGLE' if method == 'peagle' else 'EAGLE-3'} | {step} | {tokens:,} | " + " | ".join(
            f"{c['mean_acceptance_length']:.3f} ({c['acceptance_per_position'][0]:.3f}, "
            f"{c['acceptance_per_position'][1]:.3f})" if (c := cells.get(ds)) else "" for ds in SLICE) + " |")
    same = {ds: len({r["outputs_sha256"] for r in rows if r["dataset"] == ds}) <= 1 for ds in SLICE}
    lines += ["", "Every head produced the same tokens on each set (greedy, lossless): "
              + ", ".join(f"{ds} {'yes' if ok else 'NO (a losslessness bug)'}" for ds, ok in same.items()) + "."]
    return "\n".join(lines)


def finished(work: Path) -> bool:
    return all(final_step(work / m) is not None for m in METHODS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", action="append", type=Path,
                    help="a round's folder (runs/campaign); again for each later round, in order")
    ap.add_argument("--rounds", type=Path, help="a folder of rounds (scripts/campaign_rounds.py): each subfolder is "
                                                "a round, measured without the bundled heads")
    ap.add_argument("--every", type=int, default=EVERY, help="measure every N-th step's checkpoint")
    ap.add_argument("--watch", action="store_true", help="keep measuring new checkpoints until every round's heads "
                                                         "finish")
    args = ap.parse_args()
    works = args.work or [Path("runs/campaign")]

    def rounds() -> list[Path]:
        found = sorted(p for p in args.rounds.iterdir() if p.is_dir()) if args.rounds and args.rounds.exists() else []
        return works + found

    def measure_all() -> None:
        for i, work in enumerate(rounds()):
            measure_pending(work, args.every, bundled=i == 0)

    while True:
        measure_all()
        if not args.watch or (not args.rounds and all(finished(w) for w in works)):
            break
        time.sleep(POLL_SECONDS)
    measure_all()
    for work in rounds():
        if (work / "slices" / "results.jsonl").exists():
            print(f"{work}:\n{table(work)}\n")


if __name__ == "__main__":
    main()
