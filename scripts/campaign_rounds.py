"""The campaign's rounds: how its progress survives fresh machines.

Checkpoints stay out of git and a machine may not be kept, so the only training that outlives a session is a
re-bundled head. The campaign therefore trains in *rounds* small enough to finish on one machine in a working
session: a round continues the bundled head on the next ROWS conversations of the campaign's pool that it has not
trained on, measures the finished head against the bundled one side by side on this machine, and re-bundles it
only when it is clearly better. Either way the head's cursor moves past the round's rows, so the next round, on
this machine or a fresh one, trains on new conversations (repeating a round from the same bundle, data and seed
would only reproduce its result). data/heads/campaign.json, committed with the bundles, keeps the cursors and a
record of every round: the learning curve's rows.

    python3 scripts/campaign_rounds.py next --method peagle --rows 3200 --rounds runs/campaign/rounds \\
        --heldout runs/campaign/heldout.jsonl SOURCE[:FIRST_LINE]...     # prints the round's folder
    python3 scripts/campaign_rounds.py close --method peagle --round ROUND --acceptance NEW.json \\
        --baseline BUNDLED.json                                           # gate, bundle, record, advance
    python3 scripts/campaign_rounds.py start --method peagle --rounds runs/campaign/rounds   # the head to continue
    python3 scripts/campaign_rounds.py table                              # the rounds so far, as a table
    python3 scripts/campaign_rounds.py plot --out docs/heads/campaign-curve   # the learning curve along the line

A round continues the head of the method's last round when that head is on this machine, bundled or not: a round
that gained on one set only (code answers move HumanEval, not MT-Bench) is not thrown away, and the gain of the next
rounds adds to it until the head clears the bundle on both sets. On a fresh machine the line starts again from the
bundle.

The pool is the SOURCE files in order (from line FIRST_LINE, 1-based), less the held-out conversations: sources only
ever grow at their end (answers are appended as they are made), so a row's place in the pool never changes. A
SOURCE may be a group of finished files joined by "+" (PATH[:FIRST_LINE]+PATH...): their lines are shuffled together
with a fixed seed, so that a round past the group's start trains on a mix of them, not on one file's kind alone (a
group's files must be complete, or its order would change as they grew).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bundle_head import MIN_GAIN, bundle, deepest_mal, deepest_rows, gain_lower_bound, not_better  # noqa: E402
from campaign_slices import records, tokens_seen  # noqa: E402

from peagle.train.data import open_text  # noqa: E402

STATE = ROOT / "data" / "heads" / "campaign.json"
BUNDLES = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}
# What the cursors count (scripts/campaign.sh composes it; changing its order would make them meaningless)
POOL = ("the conversations the second bundle had not trained on, in this order, less the 32 held out: "
        "smollm2-regenerated-2 from line 1,217, smollm2-regenerated-3, the first 1,280 code answers; the rest of the "
        "code answers and the multi-turn conversations, shuffled together (seed 0); the answers to prompts-4 "
        "(chat and code, mixed); the answers to prompts-5 (questions the target wrote and code, mixed) as they are "
        "answered")
HELDOUT_DEPTHS = 3  # held-out accuracy recorded per round, at depths 1..HELDOUT_DEPTHS
NOT_ENOUGH_ROWS = 3  # `next`'s exit status when the pool has fewer than ROWS new conversations (yet)


def load_state(path: Path = STATE) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"pool": POOL, "trained_rows": {m: 0 for m in BUNDLES}, "rounds": []}


def save_state(state: dict, path: Path = STATE) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(path)


GROUP_SEED = 0


def source_lines(source: str, heldout: set[str], group: bool = False) -> list[str]:
    """One SOURCE's lines: PATH[:FIRST_LINE] (none while the file is not there yet), or finished files joined by
    "+" and shuffled together."""
    if "+" in source:
        lines = [line for part in source.split("+") for line in source_lines(part, heldout, group=True)]
        random.Random(GROUP_SEED).shuffle(lines)
        return lines
    path, _, first = source.partition(":")
    if not Path(path).exists():  # answers not begun yet; a group's files, finished, are always there
        if group:
            raise SystemExit(f"campaign_rounds: {path} is missing, but a group's files must be finished")
        return []
    with open_text(path) as f:
        text = f.read()
    return [line for n, line in enumerate(text.splitlines(), 1)
            if n >= int(first or 1) and line.strip() and json.loads(line)["id"] not in heldout]


def pool(sources: list[str], heldout: set[str]) -> list[str]:
    """The pool's lines: each SOURCE in order, held-out conversation ids left out."""
    return [line for source in sources for line in source_lines(source, heldout)]


def round_dir(rounds: Path, first: int, rows: int) -> Path:
    """A round's folder, named by its rows: two heads at the same cursor share it (its data and teacher cache)."""
    return rounds / f"rows-{first:06d}-{first + rows:06d}"


def next_round(method: str, rows: int, rounds: Path, sources: list[str], heldout: set[str],
               state_path: Path = STATE) -> Path | None:
    """The folder of `method`'s next round, with its train.jsonl written; None when the pool is short of ROWS.
    A round already begun at the cursor (by either head) is that round, whatever ROWS is now: a campaign restarted
    with another ROWS (another machine, a shorter session) finishes it rather than leave it half trained."""
    first = load_state(state_path)["trained_rows"][method]
    begun = sorted(rounds.glob(f"rows-{first:06d}-*/train.jsonl"))
    if begun:
        return begun[0].parent
    lines = pool(sources, heldout)[first:first + rows]
    if len(lines) < rows:
        return None
    out = round_dir(rounds, first, rows)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "train.jsonl").exists():
        tmp = out / "train.jsonl.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(out / "train.jsonl")
    return out


def start_head(method: str, rounds: Path, state_path: Path = STATE) -> str:
    """The head `method`'s next round continues: its last recorded round's, when that head is on this machine;
    otherwise the bundled head's name."""
    last = [rec for rec in load_state(state_path)["rounds"] if rec["method"] == method]
    if last:
        head = round_dir(rounds, last[-1]["rows"][0], last[-1]["rows"][1] - last[-1]["rows"][0]) / method
        if (head / "model.safetensors").exists() and (head / "training_args.json").exists():
            return str(head)
    return BUNDLES[method]


def machine_name() -> str:
    """The CPU and the kernels it ran, as benchmarks/acceptance.py's reports name them."""
    from peagle.bench.plan import machine

    m = machine()
    return f"{m['cuda'] or m['cpu']}, {m['kernels']['kernels']} kernels"


def tokens_and_steps(run: Path) -> tuple[int, int]:
    """Training tokens and steps of a finished run, from its train_log.jsonl (a resumed step counted once)."""
    steps = max((rec["step"] for rec in records(run / "train_log.jsonl")), default=0)
    return tokens_seen(run, steps), steps


def close_round(method: str, round_path: Path, acceptance: Path, baseline: Path, state_path: Path = STATE,
                bundle_fn=bundle, min_gain: float = MIN_GAIN) -> dict:
    """Gate the round's finished head against the bundled one (both measured on this machine), re-bundle it when it
    is clearly better, record the round and move the head's cursor past its rows. Closing a round twice records it
    once."""
    state = load_state(state_path)
    first, end = (int(x) for x in round_path.name.split("-")[1:3])
    for rec in state["rounds"]:
        if rec["method"] == method and rec["rows"] == [first, end]:
            return rec
    if state["trained_rows"][method] != first:
        raise SystemExit(f"{round_path}: {method}'s cursor is at row {state['trained_rows'][method]:,}, not at this "
                         f"round's first row {first:,}; was the round closed already?")
    new, old = json.loads(acceptance.read_text()), json.loads(baseline.read_text())
    reasons = not_better(new, old, method, min_gain)
    # Greedy speculative decoding is lossless, so on one machine both heads must have produced the same tokens.
    digests = {(r["dataset"], r["outputs_sha256"]) for r in new + old if r["method"] == method and "outputs_sha256" in r}
    if len(digests) != len({ds for ds, _ in digests}):
        reasons.append("the two heads' greedy outputs differ on one machine: a losslessness bug, not a better head")
    tokens, steps = tokens_and_steps(round_path / method)
    data_meta = round_path / "train-data" / "peagle_data.json"
    packed_to = json.loads(data_meta.read_text()).get("packed_to") if data_meta.exists() else None
    args = round_path / method / "training_args.json"
    trained_with = json.loads(args.read_text()) if args.exists() else {}
    lm_head = "frozen" if trained_with.get("freeze_lm_head") else "trained"
    # The held-out accuracy the trainer measured at the round's end (the same 32 conversations in every round)
    evaluation = round_path / method / "eval.json"
    heldout = ([round(a, 4) for a in json.loads(evaluation.read_text())["accuracy_per_depth"][:HELDOUT_DEPTHS]]
               if evaluation.exists() else None)
    started = round_path / f"{method}.started_from"
    started_from = started.read_text().strip() if started.exists() else BUNDLES[method]
    rec = {"method": method, "rows": [first, end], "steps": steps, "tokens": tokens, "packed_to": packed_to,
           "lm_head": lm_head, "lr": trained_with.get("lr"), "started_from": started_from,
           "heldout_accuracy": heldout,
           "mean_acceptance_length": {ds: v for ds, (k, v) in deepest_mal(new, method).items()},
           "bundled_mean_acceptance_length": {ds: v for ds, (k, v) in deepest_mal(old, method).items()},
           "k": max(k for k, _ in deepest_mal(new, method).values()),
           "bundled": not reasons, "why_not": reasons,
           # the paired bootstrap's 95% lower bound of the mean gain over the sets (None: no per-prompt counts)
           "gain_lower_bound": _bound(new, old, method),
           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_name()}
    if not reasons:
        bundle_fn(round_path / method, BUNDLES[method])
    state["trained_rows"][method] = end
    state["rounds"].append(rec)
    save_state(state, state_path)
    # The teacher outputs the heads share are kept only while the other head has this round still to train.
    other = next(m for m in BUNDLES if m != method)
    if state["trained_rows"][other] != first:
        shutil.rmtree(round_path / "teacher-cache", ignore_errors=True)
    return rec


def _bound(new: list[dict], old: list[dict], method: str) -> float | None:
    new_rows, old_rows = deepest_rows(new, method), deepest_rows(old, method)
    if not new_rows or set(old_rows) - set(new_rows):
        return None
    bound = gain_lower_bound(new_rows, old_rows)
    return None if bound is None else round(bound, 4)


def _start_name(started_from: str) -> str:
    """'the bundle', or the rows of the round whose head a round continued."""
    if started_from in BUNDLES.values():
        return "the bundle"
    first, end = Path(started_from).parent.name.split("-")[1:3]
    return f"rows {int(first):,}-{int(end):,}'s head"


def _rate(lr: float) -> str:
    """A learning rate as the campaign writes it: 5.0e-4."""
    return f"{lr:.1e}".replace("e-0", "e-")


def table(state: dict) -> str:
    """The rounds as a markdown table: the campaign's learning curve in benchmark acceptance, a row per round."""
    out = ["| head | rows | steps | tokens | tokens along its line | K | HumanEval: round / bundle | "
           "MT-Bench: round / bundle | held-out accuracy, depths 1-2 | re-bundled | started from | rows per step | "
           "LM head | lr | machine |", "|---|---|---:|---:|---:|---:|---|---|---|---|---|---|---|---:|---|"]
    line = {id(rec): seen for method in BUNDLES for rec, seen in line_tokens(state, method)}
    for rec in state["rounds"]:
        cells = []
        for ds in ("humaneval", "mtbench"):
            new, old = rec["mean_acceptance_length"].get(ds), rec["bundled_mean_acceptance_length"].get(ds)
            cells.append(f"{new:.3f} / {old:.3f} ({new / old - 1:+.1%})" if new and old else "")
        verdict = "yes" if rec["bundled"] else "no: " + "; ".join(rec["why_not"])
        heldout = " / ".join(f"{a:.3f}" for a in (rec.get("heldout_accuracy") or [])[:2])
        out.append(f"| {rec['method']} | {rec['rows'][0]:,}-{rec['rows'][1]:,} | {rec['steps']} | {rec['tokens']:,} | "
                   f"{line[id(rec)]:,} | {rec['k']} | {cells[0]} | {cells[1]} | {heldout} | {verdict} | "
                   f"{_start_name(rec.get('started_from', BUNDLES[rec['method']]))} | "
                   f"{'1 packed to ' + str(rec['packed_to']) + ' tokens' if rec.get('packed_to') else '4 conversations'}"
                   f" | {rec.get('lm_head', 'frozen')} | {_rate(rec.get('lr') or 5e-4)} | {rec['machine']} |")
    return "\n".join(out)


def line_tokens(state: dict, method: str) -> list[tuple[dict, int]]:
    """Each of `method`'s rounds with the campaign tokens its head has trained on along its line: its own and those
    of the round it continued, back to the campaign's first round (a round started from the bundle continues the
    last round that was bundled before it)."""
    out: list[tuple[dict, int]] = []
    by_rows: dict[tuple[int, int], int] = {}
    bundled_line = 0  # the line's tokens in the bundle as it stood
    for rec in (r for r in state["rounds"] if r["method"] == method):
        start = rec.get("started_from", BUNDLES[method])
        if start in BUNDLES.values():
            before = bundled_line
        else:
            first, end = (int(x) for x in Path(start).parent.name.split("-")[1:3])
            before = by_rows[first, end]
        seen = before + rec["tokens"]
        by_rows[tuple(rec["rows"])] = seen
        if rec["bundled"]:
            bundled_line = seen
        out.append((rec, seen))
    return out


TARGETS = {"humaneval": 2.0, "mtbench": 1.8}  # P-EAGLE's mean acceptance length at K = 7 that the campaign aims at


def plot(state: dict, method: str, out: Path) -> None:
    """The learning curve along the line of rounds: benchmark mean acceptance length (all 164 + 80 prompts at the
    round's K) and held-out accuracy at depths 1-2, against the tokens the round's head has trained on."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = line_tokens(state, method)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for ds, color in (("humaneval", "tab:blue"), ("mtbench", "tab:orange")):
        pts = [(seen / 1e6, rec["mean_acceptance_length"][ds], rec["bundled"]) for rec, seen in rounds
               if ds in rec["mean_acceptance_length"]]
        top.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "-", color=color, alpha=0.35)
        for filled in (True, False):
            sel = [(x, y) for x, y, b in pts if b == filled]
            top.plot([x for x, _ in sel], [y for _, y in sel], "o", color=color,
                     markerfacecolor=color if filled else "white",
                     label=f"{ds}, {'re-bundled' if filled else 'not bundled'}")
        top.axhline(TARGETS[ds], color=color, linestyle="--", linewidth=1)
    top.set_ylabel(f"mean acceptance length, K={rounds[-1][0]['k'] if rounds else 7}")
    top.legend(fontsize=8, loc="center left")
    top.set_title(f"{BUNDLES[method]}: the campaign's rounds (dashed: the targets)")
    for depth, marker in ((0, "o"), (1, "s")):
        pts = [(seen / 1e6, rec["heldout_accuracy"][depth]) for rec, seen in rounds
               if rec.get("heldout_accuracy") and len(rec["heldout_accuracy"]) > depth]
        bottom.plot([x for x, _ in pts], [y for _, y in pts], marker + "-", label=f"held-out accuracy, depth {depth + 1}")
    bottom.set_ylabel("held-out accuracy (32 conversations)")
    bottom.set_xlabel("campaign tokens the round's head has trained on (millions)")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    nxt = sub.add_parser("next", help="write the next round's train.jsonl and print its folder")
    nxt.add_argument("--method", choices=BUNDLES, required=True)
    nxt.add_argument("--rows", type=int, required=True, help="conversations per round")
    nxt.add_argument("--rounds", type=Path, required=True, help="the folder that holds the rounds")
    nxt.add_argument("--heldout", type=Path, required=True, help="the held-out conversations (never trained on)")
    nxt.add_argument("sources", nargs="+", help="the pool's files in order, each as PATH or PATH:FIRST_LINE, or "
                     "finished files joined by + to be shuffled together")
    close = sub.add_parser("close", help="gate, re-bundle if clearly better, record the round, advance the cursor")
    close.add_argument("--method", choices=BUNDLES, required=True)
    close.add_argument("--round", type=Path, required=True)
    close.add_argument("--acceptance", type=Path, required=True, help="the round's head, measured here")
    close.add_argument("--baseline", type=Path, required=True, help="the bundled head, measured here")
    start = sub.add_parser("start", help="print the head the method's next round continues (a folder or a bundle)")
    start.add_argument("--method", choices=BUNDLES, required=True)
    start.add_argument("--rounds", type=Path, required=True, help="the folder that holds the rounds")
    sub.add_parser("table", help="print the rounds recorded in data/heads/campaign.json as a markdown table")
    plt = sub.add_parser("plot", help="draw the learning curve along the line of rounds as OUT.png")
    plt.add_argument("--method", choices=BUNDLES, default="peagle")
    plt.add_argument("--out", type=Path, default=ROOT / "docs" / "heads" / "campaign-curve")
    args = ap.parse_args()
    if args.command == "table":
        print(table(load_state()))
    elif args.command == "plot":
        plot(load_state(), args.method, args.out)
        print(f"campaign_rounds: wrote {args.out.with_suffix('.png')}")
    elif args.command == "start":
        print(start_head(args.method, args.rounds))
    elif args.command == "next":
        heldout = {json.loads(line)["id"] for line in args.heldout.read_text().splitlines() if line.strip()}
        out = next_round(args.method, args.rows, args.rounds, args.sources, heldout)
        if out is None:
            print(f"campaign_rounds: fewer than {args.rows:,} conversations past {args.method}'s cursor yet",
                  file=sys.stderr)
            sys.exit(NOT_ENOUGH_ROWS)
        print(out)
    else:
        rec = close_round(args.method, args.round, args.acceptance, args.baseline)
        mals = ", ".join(f"{ds} {v:.3f} against {rec['bundled_mean_acceptance_length'].get(ds, float('nan')):.3f}"
                         for ds, v in rec["mean_acceptance_length"].items())
        print(f"campaign_rounds: {args.method} rows {rec['rows'][0]:,}-{rec['rows'][1]:,} ({rec['steps']} steps, "
              f"{rec['tokens']:,} tokens): K={rec['k']} {mals}: "
              + ("re-bundled" if rec["bundled"] else "not bundled (" + "; ".join(rec["why_not"]) + ")"))


if __name__ == "__main__":
    main()
