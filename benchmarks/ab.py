"""Speculative configurations side by side in one process: an engine per configuration, every prompt (or batch of
prompts) run on each engine in turn, the order rotating from one prompt to the next, each call timed in this
thread's CPU seconds (one torch thread).

`peagle bench` runs its configurations one after the other, a minute or more apart; on a machine shared with other
jobs the load drifts between them by 10-20% (docs/benchmarks.md), more than the differences between two good
drafters. Interleaved like this every configuration sees the same drift, so their ratios hold to a percent or two.
Greedy outputs of every configuration are checked equal to the first one's (speculation is lossless); sampled ones
(--temperature) are seeded per prompt but differ between configurations (the same distribution, other draws).

A configuration is `none` (no speculation), `ngram`, `suffix`, `hybrid` (the suffix tree with the P-EAGLE head),
or a head at a fixed K or under the adaptive policy (K from 0 up to --max-k every step): `peagle-3`, `eagle3-1`,
`peagle-adaptive`; `+q8_0` after a head's name runs its drafter in Q8_0; `:chain` drafts chains only and `:8` trees
of 8 nodes every step (the adaptive policy's default: trees as the step's cost allows; the fixed policy's: chains);
for eagle3 heads `:dynamic` expands EAGLE-2's dynamic tree and `:leaves` the chain's side leaves (`:dynamic-8`: both);
`hybrid:noleaves` is the default hybrid with its suffix drafts kept chains (the head's trees as they are).
Four modes preset what to compare:

    python3 benchmarks/ab.py proposers        # kinds of drafter: none,suffix,hybrid on sharegpt-multiturn
    python3 benchmarks/ab.py policies --batch 4           # one head's policies: none,peagle-3,peagle-adaptive
    python3 benchmarks/ab.py heads --quantization q4_0    # heads at concurrency 1: none,peagle-1,peagle-3,...
    python3 benchmarks/ab.py trees            # draft trees against the best chains, 16 held-out prompts
    python3 benchmarks/ab.py proposers --configs none,peagle-adaptive,suffix,hybrid --ignore-eos
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MODES = {  # mode -> the defaults it presets (each overridden by its flag)
    "proposers": {"configs": "none,suffix,hybrid", "datasets": ["sharegpt-multiturn"], "num_prompts": 6,
                  "max_tokens": 160, "rounds": 2, "max_k": 7},
    "policies": {"configs": "none,peagle-3,peagle-adaptive", "datasets": ["humaneval"], "num_prompts": 8,
                 "max_tokens": 64, "rounds": 4, "max_k": 7},
    "heads": {"configs": "none,peagle-1,peagle-3,peagle-adaptive,eagle3-1", "datasets": ["humaneval", "mtbench"],
              "num_prompts": 8, "max_tokens": 64, "rounds": 1, "max_k": 3},
    "trees": {"configs": "none,peagle-3,peagle-adaptive:chain,peagle-adaptive,peagle-3:8,eagle3-adaptive",
              "datasets": ["mtbench", "humaneval"], "num_prompts": 8, "max_tokens": 96, "rounds": 1, "max_k": 3},
}
MODEL_FREE = ("ngram", "suffix")


def engine_options(name: str, args) -> dict:
    """`LLMEngine.from_pretrained`'s speculative config and policy for one configuration name."""
    from peagle.config import EAGLE2_BEAMS
    from peagle.model.heads import DEFAULT_HEADS

    heads = {"peagle": args.peagle_head or DEFAULT_HEADS["peagle"],
             "eagle3": args.eagle3_head or DEFAULT_HEADS["eagle3"]}
    name, _, tree = name.partition(":")
    base, _, drafter_format = name.partition("+")
    if base == "none":
        return {"speculative_config": None}
    if base in MODEL_FREE:
        return {"speculative_config": {"method": base}}
    if base == "hybrid":
        nodes = {} if tree in ("", "noleaves") else {"draft_tree_nodes": 0 if tree == "chain" else int(tree)}
        return {"speculative_config": {"method": "hybrid", "model": heads["peagle"], **nodes}}
    method, _, k = base.partition("-")
    if method not in heads or not (k == "adaptive" or k.isdigit()):
        raise SystemExit(f"unknown configuration {name!r}: none, ngram, suffix, hybrid, or HEAD-K / HEAD-adaptive "
                         "with HEAD peagle or eagle3 (e.g. peagle-3), optionally +q8_0")
    spec = {"model": heads[method], "method": "eagle3", "parallel_drafting": method == "peagle",
            "num_speculative_tokens": args.max_k if k == "adaptive" else int(k)}
    if drafter_format:
        spec["quantization"] = drafter_format
    for part in filter(None, tree.split("-")):
        if part in ("dynamic", "leaves"):
            spec["draft_tree_beams"] = EAGLE2_BEAMS if part == "dynamic" else 0
        else:
            spec["draft_tree_nodes"] = 0 if part == "chain" else int(part)
    return {"speculative_config": spec, "speculation_policy": "adaptive" if k == "adaptive" else "fixed"}


def start_engines(names: list[str], args) -> dict:
    from peagle.engine import LLMEngine, SamplingParams

    engines = {}
    for name in names:
        engines[name] = LLMEngine.from_pretrained(args.model, max_num_seqs=max(4, args.batch), device="cpu",
                                                  quantization=args.quantization, calibration_dir=args.calibration_dir,
                                                  **engine_options(name, args))
        if name.endswith(":noleaves"):  # its suffix drafts come without the tree's other continuations
            engines[name].proposer.suffix.alternatives = 0
        engines[name].generate(["Hello"], SamplingParams(max_tokens=8), cache_salt="warm-up")  # first calls allocate
    return engines


def proposer_counts(engine) -> dict[str, tuple[int, int, int]]:
    """Drafts, accepted tokens and draft-tree nodes past the trees' depth (0: chains only) so far of each proposer
    the engine asks."""
    return {p: (s.num_drafts, s.num_accepted_tokens,
                s.num_draft_tokens - sum(k * n for k, n in enumerate(s.steps_per_k)))
            for p, s in engine.proposer_stats.items()}


def run_dataset(engines: dict, dataset: str, args) -> dict:
    """Every batch of the dataset's prompts through every engine, the order rotating batch by batch; tokens and CPU
    seconds per engine, and the engines' counters over the run."""
    from peagle.bench.datasets import load_dataset
    from peagle.engine import SamplingParams

    names = list(engines)
    prompts = [p.chat_messages() for p in load_dataset(dataset, args.num_prompts)]
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    cpu, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    before = {n: e.stats.copy() for n, e in engines.items()}
    before_proposers = {n: proposer_counts(e) for n, e in engines.items()}
    for r in range(args.rounds):
        for i, batch in enumerate(batches):
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                     ignore_eos=args.ignore_eos, seed=i * args.batch + j) for j in range(len(batch))]
            turn = (i + r) % len(names)
            outputs = {}
            for n in names[turn:] + names[:turn]:
                started = time.thread_time()
                outs = engines[n].generate(batch, params, cache_salt=f"round-{r}")
                cpu[n] += time.thread_time() - started
                outputs[n] = [o.token_ids for o in outs]
                tokens[n] += sum(map(len, outputs[n]))
            if args.temperature == 0 and (differ := [n for n in names if outputs[n] != outputs[names[0]]]):
                raise SystemExit(f"{differ[0]} changed the greedy output of {dataset} batch {i}: not lossless")
    rows = {}
    for n, e in engines.items():
        s, b, was = e.stats, before[n], before_proposers[n]
        drafts, steps = s.num_drafts - b.num_drafts, sum(s.steps_per_k) - sum(b.steps_per_k)
        rows[n] = {"tokens": tokens[n], "cpu_s": round(cpu[n], 3), "tokens_per_cpu_s": round(tokens[n] / cpu[n], 2),
                   "mean_acceptance_length": round(1 + (s.num_accepted_tokens - b.num_accepted_tokens) / drafts, 4)
                   if drafts else None,
                   "drafts_per_step": round((s.num_draft_tokens - b.num_draft_tokens) / steps, 3) if steps else 0.0,
                   "tokens_per_draft": round((s.num_draft_tokens - b.num_draft_tokens) / drafts, 3) if drafts else 0.0,
                   "proposers": {p: [now - then for now, then in zip(counts, was.get(p, (0, 0, 0)))]
                                 for p, counts in proposer_counts(e).items()}}
    return rows


def report(dataset: str, rows: dict, args) -> None:
    from peagle.model import kernels

    first = next(iter(rows))
    print(f"\n{dataset}: {args.num_prompts} prompts x {args.rounds} rounds, batches of {args.batch}, up to "
          f"{args.max_tokens} tokens, temperature {args.temperature:g}, {args.quantization or 'bf16'} target, "
          f"{kernels.describe()}, thread CPU time\n")
    print(f"| configuration | output tokens per CPU s | vs {first} | mean acceptance length | drafts per step | "
          "draft tokens per draft | drafts (accepted tokens, tree nodes past the depth) per proposer |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for n, r in rows.items():
        mal = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "-"
        shown = ", ".join(f"{p} {d} ({a}, {x})" for p, (d, a, x) in r["proposers"].items()) or "-"
        print(f"| {n} | {r['tokens_per_cpu_s']:.1f} | {r['tokens_per_cpu_s'] / rows[first]['tokens_per_cpu_s']:.3f}x | "
              f"{mal} | {r['drafts_per_step']:.2f} | {r['tokens_per_draft']:.2f} | {shown} |")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=list(MODES), help="what the defaults compare")
    ap.add_argument("--configs", help="comma-separated configurations; the first is the reference of the ratios and "
                    "of the outputs [the mode's]")
    ap.add_argument("--datasets", nargs="+", help="`peagle bench` datasets [the mode's]")
    ap.add_argument("--num-prompts", type=int, help="per dataset [the mode's]")
    ap.add_argument("--max-tokens", type=int, help="[the mode's]")
    ap.add_argument("--rounds", type=int, help="passes over the prompts [the mode's]")
    ap.add_argument("--max-k", type=int, help="the adaptive policy's largest K [the mode's]")
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (a static batch: concurrency N)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs checked equal)")
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per prompt")
    ap.add_argument("--model", default=None, help="target (default: the embedded model); e.g. smollm2-q4_1")
    ap.add_argument("--quantization", default=None, choices=["q4_0", "q4_1", "q8_0"], help="the target's, at load")
    ap.add_argument("--peagle-head", default=None, help="a head folder or bundled name for peagle-* and hybrid")
    ap.add_argument("--eagle3-head", default=None, help="a head folder or bundled name for eagle3-*")
    ap.add_argument("--calibration-dir", type=Path, default=None,
                    help="engines of the same shapes share the start-up timings kept here: their cost models start "
                         "equal, so their ratios show their drafting rather than the noise of their own timings")
    ap.add_argument("--out", help="write the results as JSON here")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    for key, value in MODES[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = args.configs.split(",")
    for name in names:  # a bad name fails before any engine loads
        engine_options(name, args)
    torch.set_num_threads(1)
    engines = start_engines(names, args)
    results = {}
    for dataset in args.datasets:
        results[dataset] = run_dataset(engines, dataset, args)
        report(dataset, results[dataset], args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
