"""What a speculative step costs with each bundled head at the same K, and how much of it is drafting: the same
prompts, greedy, batch 1, one torch thread, timed in CPU seconds of this process (so other work on the machine
does not count), with the drafter's own calls timed inside the engine.

    python3 benchmarks/drafter_step_cost.py --k 1 --max-tokens 128 [--quantization q4_0]

At K = 1 both methods draft one token, so the comparison isolates the drafters: P-EAGLE's head has two layers to
EAGLE-3's one, and its first draft is accepted more often (fewer steps for the same tokens). Each head runs twice,
its layers as one native call each (what the engine does) and as PyTorch modules (the same bits).
"""
from __future__ import annotations

import argparse
import time

import torch

from peagle.engine.engine import LLMEngine
from peagle.engine.sampling import SamplingParams
from peagle.model import drafter as drafter_module
from peagle.model.heads import DEFAULT_HEADS

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain what a hash table is, and when a list is the better choice.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"",
    "What are three tips for writing a clear bug report?",
]


def timed_drafting() -> dict[str, float]:
    """Wrap the drafter's two entry points so that their CPU time adds up in the returned dict."""
    spent: dict[str, float] = {"seconds": 0.0}
    for name in ("draft_parallel", "draft_chain"):
        original = getattr(drafter_module.Drafter, name)

        def timed(self, *args, _original=original, **kwargs):
            t0 = time.process_time()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent["seconds"] += time.process_time() - t0
        setattr(drafter_module.Drafter, name, timed)
    return spent


def measure(methods: list[str], k: int, max_tokens: int, quantization: str | None, spent: dict[str, float]) -> list:
    """Each head twice, its layers in native calls and as PyTorch modules (the same bits, so the same steps),
    every prompt run by every variant in turn so that load from other processes hits them alike."""
    engines = {}
    for method in methods:
        spec = {"model": DEFAULT_HEADS[method], "method": "eagle3", "num_speculative_tokens": k,
                "parallel_drafting": method == "peagle"}
        for layers in ("native", "modules"):
            engine = LLMEngine.from_pretrained(None, spec, max_num_seqs=1, device="cpu", speculation_policy="fixed",
                                               quantization=quantization)
            if layers == "modules":
                engine.drafter.native_layers = None
            engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16), chat=True)  # warm-up
            engines[method, layers] = engine
    totals = {key: {"cpu_s": 0.0, "draft_s": 0.0, "tokens": 0, "steps": 0} for key in engines}
    for prompt in PROMPTS:  # one request at a time: batch 1
        for key, engine in engines.items():
            before, spent["seconds"], t0 = engine.stats.num_drafts, 0.0, time.process_time()
            totals[key]["tokens"] += len(engine.generate([prompt], SamplingParams(max_tokens=max_tokens),
                                                         chat=True)[0].token_ids)
            totals[key]["cpu_s"] += time.process_time() - t0
            totals[key]["draft_s"] += spent["seconds"]
            totals[key]["steps"] += engine.stats.num_drafts - before
    return [{"method": m, "layers": layers, "tokens": t["tokens"], "steps": t["steps"],
             "tokens_per_cpu_s": t["tokens"] / t["cpu_s"], "ms_per_step": 1000 * t["cpu_s"] / t["steps"],
             "drafter_ms_per_step": 1000 * t["draft_s"] / t["steps"], "tokens_per_step": t["tokens"] / t["steps"]}
            for (m, layers), t in totals.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quantization", default=None, choices=["q4_0", "q4_1", "q8_0"],
                    help="the target's weights (its drafter then runs in Q8_0), as `peagle bench --quantization`")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spent = timed_drafting()
    rows = measure(["eagle3", "peagle"], args.k, args.max_tokens, args.quantization, spent)
    print(f"K={args.k}, batch 1, {len(PROMPTS)} prompts x up to {args.max_tokens} tokens, "
          f"{args.quantization or 'bf16'} target, CPU time of one thread")
    print("| head | drafter layers | tokens | steps | tokens per step | ms per step | of it drafting | "
          "tokens per CPU-second |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['layers']} | {r['tokens']} | {r['steps']} | {r['tokens_per_step']:.3f} | "
              f"{r['ms_per_step']:.1f} | {r['drafter_ms_per_step']:.2f} | {r['tokens_per_cpu_s']:.1f} |")


if __name__ == "__main__":
    main()
