"""What a speculative step costs with each bundled head at the same K, and how much of it is drafting: the same
prompts, greedy, batch 1, one torch thread, timed in CPU seconds of this process (so other work on the machine
does not count), with the drafter's own calls timed inside the engine.

    python3 benchmarks/drafter_step_cost.py --k 1 --max-tokens 128

At K = 1 both methods draft one token, so the comparison isolates the drafters: P-EAGLE's head has two layers to
EAGLE-3's one, and its first draft is accepted more often (fewer steps for the same tokens).
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


def measure(method: str, k: int, max_tokens: int, spent: dict[str, float]) -> dict:
    spec = {"model": DEFAULT_HEADS[method], "method": "eagle3", "num_speculative_tokens": k,
            "parallel_drafting": method == "peagle"}
    engine = LLMEngine.from_pretrained(None, spec, max_num_seqs=1, device="cpu", speculation_policy="fixed")
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16), chat=True)  # warm-up
    spent["seconds"] = 0.0
    t0, tokens, steps = time.process_time(), 0, 0
    for prompt in PROMPTS:  # one request at a time: batch 1
        before = engine.stats.num_drafts
        tokens += len(engine.generate([prompt], SamplingParams(max_tokens=max_tokens), chat=True)[0].token_ids)
        steps += engine.stats.num_drafts - before
    cpu = time.process_time() - t0
    return {"method": method, "k": k, "tokens": tokens, "steps": steps, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu, "ms_per_step": 1000 * cpu / steps,
            "drafter_ms_per_step": 1000 * spent["seconds"] / steps, "tokens_per_step": tokens / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spent = timed_drafting()
    rows = [measure(m, args.k, args.max_tokens, spent) for m in ("eagle3", "peagle")]
    print(f"K={args.k}, batch 1, {len(PROMPTS)} prompts x up to {args.max_tokens} tokens, CPU time of one thread")
    print("| head | tokens | steps | tokens per step | ms per step | of it drafting | tokens per CPU-second |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['tokens']} | {r['steps']} | {r['tokens_per_step']:.3f} | {r['ms_per_step']:.1f} | "
              f"{r['drafter_ms_per_step']:.2f} | {r['tokens_per_cpu_s']:.1f} |")


if __name__ == "__main__":
    main()
