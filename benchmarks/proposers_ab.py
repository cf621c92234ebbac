"""Drafters side by side in one process: an engine per method (no speculation, P-EAGLE, n-gram, suffix, the hybrid),
every prompt (or batch of prompts) run on each engine in turn, the order alternating from one prompt to the next,
each call timed in this thread's CPU seconds.

`peagle bench` runs its methods one after the other, a minute or more apart; on a machine shared with other jobs
the memory system's load drifts between them by 10-20% (docs/benchmarks.md), more than the differences between
two good drafters. Interleaved like this every method sees the same drift, so their ratios hold to a percent or
two. Greedy outputs of every method are checked equal to no speculation's; sampled ones (--temperature) are seeded
per prompt but differ between methods (the same distribution, other draws). The same interleaving compares one
head's policies in benchmarks/policy_ab.py and heads at each K in benchmarks/c1_interleaved.py; this one compares
kinds of drafter.

    OMP_NUM_THREADS=1 python3 benchmarks/proposers_ab.py --dataset sharegpt-multiturn --methods none,suffix,hybrid
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from peagle.bench.datasets import load_dataset
from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model.heads import embedded_speculative_config

METHODS = ("none", "peagle", "ngram", "suffix", "hybrid")


def speculative_config(method: str, head: str, k: int) -> SpeculativeConfig | None:
    if method == "none":
        return None
    if method == "peagle":
        return SpeculativeConfig.for_head(head, k, parallel_drafting=True)
    return SpeculativeConfig(method=method, model=head if method == "hybrid" else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="sharegpt-multiturn", help="a `peagle bench` dataset")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs checked equal)")
    ap.add_argument("--methods", default="none,suffix,hybrid", help=f"comma-separated, from {', '.join(METHODS)}; "
                    "the first is the reference of the ratios and of the outputs")
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (a static batch: concurrency N)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts (each with empty caches)")
    ap.add_argument("--k", type=int, default=7, help="P-EAGLE's largest K (its policy is adaptive)")
    ap.add_argument("--model", default=None, help="target (default: the embedded model); e.g. smollm2-q4_1")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    methods = args.methods.split(",")
    if bad := [m for m in methods if m not in METHODS]:
        ap.error(f"unknown method {bad[0]!r}: choose from {', '.join(METHODS)}")
    torch.set_num_threads(1)
    prompts = [p.chat_messages() for p in load_dataset(args.dataset, args.num_prompts)]
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    head = embedded_speculative_config().model
    engines = {}
    for m in tqdm(methods, desc="starting engines"):
        engines[m] = LLMEngine.from_pretrained(args.model, speculative_config(m, head, args.k),
                                               max_num_seqs=max(4, args.batch), device="cpu")
        engines[m].generate(prompts[:1], SamplingParams(max_tokens=8), cache_salt="warm-up")
    cpu, tokens = dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0)
    with tqdm(total=args.rounds * len(batches) * len(methods), desc="calls") as bar:
        for r in range(args.rounds):
            for i, batch in enumerate(batches):
                outputs = {}
                params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                         ignore_eos=args.ignore_eos, seed=i * args.batch + j) for j in range(len(batch))]
                for m in methods if (i + r) % 2 == 0 else methods[::-1]:
                    started = time.thread_time()
                    outs = engines[m].generate(batch, params, cache_salt=f"round-{r}")
                    cpu[m] += time.thread_time() - started
                    outputs[m] = [o.token_ids for o in outs]
                    tokens[m] += sum(map(len, outputs[m]))
                    bar.update(1)
                if args.temperature == 0 and (differ := [m for m in methods if outputs[m] != outputs[methods[0]]]):
                    raise SystemExit(f"{differ[0]} changed the greedy output of batch {i}: not lossless")
    ref = tokens[methods[0]] / cpu[methods[0]]
    rows = []
    print(f"\n{args.dataset}, {args.num_prompts} prompts x {args.rounds} rounds, batches of {args.batch}, "
          f"{args.max_tokens} tokens, temperature {args.temperature:g}, thread CPU time\n")
    print(f"| method | output tokens per CPU s | vs {methods[0]} | drafts (accepted tokens) per proposer |")
    print("|---|---:|---:|---|")
    for m in methods:
        rate = tokens[m] / cpu[m]
        drafted = {name: (s.num_drafts, s.num_accepted_tokens) for name, s in engines[m].proposer_stats.items()}
        rows.append({"method": m, "tokens": tokens[m], "cpu_s": round(cpu[m], 3), "tokens_per_cpu_s": round(rate, 2),
                     "ratio": round(rate / ref, 4), "proposers": drafted})
        shown = ", ".join(f"{name} {d} ({a})" for name, (d, a) in drafted.items()) or "-"
        print(f"| {m} | {rate:.1f} | {rate / ref:.3f}x | {shown} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
