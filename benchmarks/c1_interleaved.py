"""Speculation's speed-up at concurrency 1, measured so that a busy machine cannot tilt it: one target shared by
every configuration (no speculation, each head at fixed K, the adaptive policy), and every prompt run by every
configuration in turn before the next prompt (the order rotating prompt by prompt), so drift in the machine's load
hits all of them alike. Output tokens per CPU-second of this process (one torch thread), summed over the prompts;
each configuration's ratio to no speculation, its mean acceptance length and the drafts it verified per step.

    python3 benchmarks/c1_interleaved.py --quantization q4_0 --num-prompts 8 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import time

import torch

CONFIGS = {  # name -> (head, K, policy, the drafter's "quantization"); head None: no speculation
    "none": (None, 0, "fixed", None),
    "peagle K=1": ("peagle", 1, "fixed", None),
    "peagle K=3": ("peagle", 3, "fixed", None),
    "peagle adaptive K<=3": ("peagle", 3, "adaptive", None),
    "eagle3 K=1": ("eagle3", 1, "fixed", None),
    "peagle K=1, q8_0 drafter": ("peagle", 1, "fixed", "q8_0"),
}
DEFAULT_CONFIGS = list(CONFIGS)[:5]


def engines(quantization: str | None, names: list[str]) -> dict:
    from peagle.config import SpeculativeConfig
    from peagle.engine import LLMEngine
    from peagle.model.checkpoint import load_head
    from peagle.model.heads import DEFAULT_HEADS, resolve_head
    from peagle.model.loading import load_tokenizer, resolve_model
    from peagle.model.quant import drafter_quantization
    from peagle.model.target import TargetModel

    path = resolve_model(None)
    target = TargetModel.from_pretrained(path, quantization=quantization)
    tokenizer = load_tokenizer(path)
    heads = {}
    out = {}
    for name in names:
        method, k, policy, fmt = CONFIGS[name]
        if method is None:
            out[name] = LLMEngine(target, tokenizer, max_num_seqs=1, enable_prefix_caching=False)
            continue
        fmt = drafter_quantization(fmt, target.quantized)
        if (method, fmt) not in heads:  # one drafter per head and format, as the engine packs it
            heads[method, fmt] = load_head(resolve_head(DEFAULT_HEADS[method], None, method=method),
                                           target_embeddings=target.input_embeddings(), dtype=torch.bfloat16)
            heads[method, fmt].pack_(fmt)
        spec = SpeculativeConfig.parse({"model": DEFAULT_HEADS[method], "method": method,
                                        "num_speculative_tokens": k, "quantization": fmt})
        out[name] = LLMEngine(target, tokenizer, heads[method, fmt], spec, max_num_seqs=1,
                              speculation_policy=policy, enable_prefix_caching=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default=None, choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--num-prompts", type=int, default=8, help="per dataset")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from peagle.bench.datasets import load_dataset
    from peagle.engine import SamplingParams
    from peagle.model import kernels

    runs = engines(args.quantization, args.configs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for e in runs.values():  # warm-up: first calls allocate
        e.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))
    results = {}
    for dataset in args.datasets:
        prompts = load_dataset(dataset, args.num_prompts)
        cpu = {n: 0.0 for n in runs}
        tokens = {n: 0 for n in runs}
        before = {n: e.stats.copy() for n, e in runs.items()}
        texts = {}
        for i, p in enumerate(prompts):
            order = args.configs[i % len(args.configs):] + args.configs[:i % len(args.configs)]
            for n in order:
                t = time.thread_time()
                out = runs[n].generate([p.chat_messages()], params, chat=True)[0]
                cpu[n] += time.thread_time() - t
                tokens[n] += out.num_output_tokens
                texts.setdefault(i, set()).add(tuple(out.token_ids))
        same = all(len(v) == 1 for v in texts.values())
        rows = {}
        for n, e in runs.items():
            s = e.stats.copy()
            drafts = s.num_drafts - before[n].num_drafts
            accepted = s.num_accepted_tokens - before[n].num_accepted_tokens
            steps = sum(s.steps_per_k) - sum(before[n].steps_per_k)
            draft_tokens = s.num_draft_tokens - before[n].num_draft_tokens
            rows[n] = {"tokens": tokens[n], "cpu_s": round(cpu[n], 3), "tokens_per_cpu_s": tokens[n] / cpu[n],
                       "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                       "drafts_per_step": draft_tokens / steps if steps else 0.0}
        base = rows["none"]["tokens_per_cpu_s"] if "none" in rows else None
        print(f"\n{dataset}: {len(prompts)} prompts x up to {args.max_tokens} tokens, {args.quantization or 'bf16'} "
              f"target, {kernels.describe()}; greedy outputs identical across configurations: {same}")
        print("| configuration | tokens per CPU-s | vs none | mean acceptance length | drafts per step |")
        print("|---|---:|---:|---:|---:|")
        for n, r in rows.items():
            mal = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "-"
            ratio = f"{r['tokens_per_cpu_s'] / base:.2f}x" if base else "-"
            print(f"| {n} | {r['tokens_per_cpu_s']:.1f} | {ratio} | {mal} | {r['drafts_per_step']:.2f} |")
        results[dataset] = {"same_outputs": same, "configs": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "kernels": kernels.describe(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
