"""Interleaved A/B of speculation policies on one engine process, in output tokens per CPU second (on a machine
shared with other work, wall time mostly measures the scheduler): plain decoding, fixed K, the adaptive policy,
and `plain-steps` (the speculative engine forced to K = 0: what keeping the drafter current costs). Every pass runs
the same prompts through each engine in turn, alternating the order; the adaptive engine keeps what it learnt
from one pass to the next (docs/benchmarks.md, "Reading").

    python3 benchmarks/policy_ab.py --dataset humaneval --batch 4 --engines plain,plain-steps,adaptive
    python3 benchmarks/policy_ab.py --method eagle3 --dataset mtbench --batch 8 --engines plain,3,7,adaptive
    python3 benchmarks/policy_ab.py --dataset custom:runs/counting/bench.jsonl --head runs/counting/head \\
        --batch 1 --engines plain,3,adaptive
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--method", choices=("peagle", "eagle3"), default="peagle",
                    help="parallel drafting (P-EAGLE) or the EAGLE-3 chain")
    ap.add_argument("--head", default=None, help="a head folder or bundled name [the bundled head of --method]")
    ap.add_argument("--max-k", type=int, default=7, help="the adaptive policy's largest K")
    ap.add_argument("--engines", default="plain,plain-steps,3,adaptive",
                    help="comma-separated: plain, plain-steps, adaptive, or a fixed K")
    ap.add_argument("--batch", type=int, default=4, help="requests decoded together")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from peagle.bench.datasets import load_dataset
    from peagle.engine import LLMEngine, SamplingParams
    from peagle.engine.policy import FixedK

    class PlainSteps(FixedK):
        def choose(self, requests):
            return [0] * len(requests)

    head = args.head or f"smollm2-135m-{args.method}"
    spec = {"model": head, "method": "eagle3", "num_speculative_tokens": args.max_k,
            "parallel_drafting": args.method == "peagle"}
    adaptive = LLMEngine.from_pretrained(None, spec, max_num_seqs=args.batch, speculation_policy="adaptive")
    engines = {}
    for name in args.engines.split(","):
        if name == "adaptive":
            engines[name] = adaptive
        elif name == "plain":
            engines[name] = LLMEngine(adaptive.target, adaptive.tokenizer, max_num_seqs=args.batch)
        else:
            k = args.max_k if name == "plain-steps" else int(name)
            eng = LLMEngine(adaptive.target, adaptive.tokenizer, adaptive.drafter,
                            adaptive.spec.model_copy(update={"num_speculative_tokens": k}), max_num_seqs=args.batch)
            if name == "plain-steps":
                eng.policy = PlainSteps(k)
            engines[name] = eng
    prompts = [p.chat_messages() for p in load_dataset(args.dataset, args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(args.passes):
        for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
            t0 = time.thread_time()
            outs = engines[name].generate(prompts, params, chat=True)
            rates[name].append(round(sum(len(o.token_ids) for o in outs) / (time.thread_time() - t0), 1))
        print(f"pass {i + 1}: " + ", ".join(f"{n} {r[-1]}" for n, r in rates.items()), flush=True)
    print(json.dumps({"tokens_per_cpu_second": rates, "adaptive_steps_per_k": adaptive.stats.steps_per_k,
                      "adaptive_step_cost_ms": [round(adaptive.policy.cost.predict(args.batch * (k + 1), args.batch, k)
                                                      * 1000, 1) for k in range(args.max_k + 1)]}))


if __name__ == "__main__":
    main()
