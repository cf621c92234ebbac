"""The decoding engine's measurements (docs/engine.md), side by side in one run on the embedded SmolLM2 (bf16, batch 1):

  1. plain decoding: peagle's engine vs transformers `generate()` (greedy, same prompt, same new-token count);
  2. drafter time per step against K, chain (EAGLE-3: K passes) vs parallel (P-EAGLE: one pass), on a
     512-token context.

    python benchmarks/engine_decode.py --max-tokens 256 --out docs/engine_decode.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from peagle.engine import LLMEngine, SamplingParams
from peagle.model.checkpoint import random_head
from peagle.model.loading import embedded_model_dir
from peagle.model.mask_token import choose_mask_token_id
from peagle.model.target import TargetModel

def clock() -> float:
    """CPU time of this process when torch runs one thread (on a shared machine it does not count the time other
    processes hold the core), wall time with more threads."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and an example."


def bench_plain(max_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    engine = LLMEngine(TargetModel.from_pretrained(path), tok, max_num_seqs=1, max_model_len=1024)
    ids = engine.encode_prompt(PROMPT, chat=True)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.tensor([ids])
    ours, theirs = [], []
    engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    for _ in range(repeats):  # interleaved, so machine noise hits both alike
        t = clock()
        out = engine.generate([ids], params)[0]
        ours.append(len(out.token_ids) / (clock() - t))
        t = clock()
        with torch.inference_mode():
            g = hf.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        theirs.append((g.shape[1] - x.shape[1]) / (clock() - t))
    return {"peagle_tokens_per_s": statistics.median(ours), "transformers_tokens_per_s": statistics.median(theirs),
            "speedup": statistics.median(ours) / statistics.median(theirs), "max_tokens": max_tokens,
            "prompt_tokens": len(ids)}


def bench_drafting(ks: list[int], context: int, iters: int) -> dict:
    from transformers import AutoTokenizer

    path = embedded_model_dir()
    target = TargetModel.from_pretrained(path)
    mask_id = choose_mask_token_id(AutoTokenizer.from_pretrained(path), target.config.vocab_size)
    heads = {"parallel": random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=mask_id),
             "chain": random_head(target.config, target.embed_tokens.weight, "eagle3")}
    for head in heads.values():
        head.pack_()  # as the engine does
    H3 = 3 * target.config.hidden_size
    out = {}
    for mode, head in heads.items():
        cache = head.new_cache(1, context + 64)
        slots = torch.tensor([0])
        # Fill the drafter cache with `context` rows, then time drafting from 2 new real rows per step.
        ctx_tok = torch.randint(100, 40000, (1, context))
        from peagle.model.layers import BatchLayout

        head(ctx_tok, torch.randn(1, context, H3, dtype=torch.bfloat16),
             BatchLayout.build(slots, torch.arange(context)[None]), cache)
        draft = head.draft_parallel if mode == "parallel" else head.draft_chain
        tok = torch.randint(100, 40000, (1, 2))
        feat = torch.randn(1, 2, H3, dtype=torch.bfloat16)
        args = (tok, feat, torch.tensor([2]), torch.tensor([context]), slots, cache)
        out[mode] = {}
        for k in ks:
            draft(*args, k)
            times = []
            for _ in range(iters):
                t = clock()
                draft(*args, k)
                times.append(clock() - t)
            out[mode][k] = statistics.median(times) * 1000
    return {"drafter_ms_per_step": out, "context": context,
            "parallel_k_max_over_k1": out["parallel"][ks[-1]] / out["parallel"][ks[0]],
            "chain_k_max_over_k1": out["chain"][ks[-1]] / out["chain"][ks[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ks", default="1,3,5,7,11")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    from peagle.model import kernels

    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}, {kernels.describe()}",
              "clock": "CPU time" if torch.get_num_threads() == 1 else "wall time",
              "plain": bench_plain(args.max_tokens, args.repeats),
              "drafting": bench_drafting(ks, args.context, args.iters)}
    p = result["plain"]
    print(f"plain decoding, batch 1, {p['max_tokens']} tokens: peagle {p['peagle_tokens_per_s']:.1f} tok/s, "
          f"transformers generate() {p['transformers_tokens_per_s']:.1f} tok/s -> {p['speedup']:.2f}x")
    d = result["drafting"]["drafter_ms_per_step"]
    print("drafter ms per step (context %d):" % args.context)
    print("  K      " + "".join(f"{k:>8}" for k in ks))
    for mode in ("parallel", "chain"):
        print(f"  {mode:<7}" + "".join(f"{d[mode][k]:8.2f}" for k in ks))
    print(f"  K={ks[-1]} / K={ks[0]}: parallel {result['drafting']['parallel_k_max_over_k1']:.2f}x, "
          f"chain {result['drafting']['chain_k_max_over_k1']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
