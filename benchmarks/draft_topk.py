"""How often the target's next token is among the drafter's top k at the first draft position: what verifying a
tree of candidates there (EAGLE-2's way: the best few tokens at a depth, each its own verify row) could add to a
step, against the one candidate a chain verifies. Real engine, greedy, batch 1, K = 1, the bundled head.

    python3 benchmarks/draft_topk.py --num-prompts 24 --max-tokens 96

The first emitted token of every step is the target's token at the drafted position (the draft when accepted,
the target's correction when not), so each step pairs the drafter's logits there with the token it should have
ranked first.
"""
from __future__ import annotations

import argparse

import torch

import peagle.engine.engine as engine_module
from peagle.bench.datasets import load_dataset
from peagle.engine.engine import LLMEngine
from peagle.engine.sampling import SamplingParams
from peagle.model import drafter as drafter_module
from peagle.model.heads import DEFAULT_HEADS

TOPS = (1, 2, 3, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--head", default=DEFAULT_HEADS["peagle"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    ranked, targets = [], []
    greedy_pick, verify_greedy = drafter_module.Drafter.greedy_pick, engine_module.verify_greedy

    def pick(self, depth, logits):  # the drafter's best candidates at depth 1, as target ids
        if depth == 0:
            ranked.append(self.to_target_ids(logits[0].topk(max(TOPS)).indices))
        return greedy_pick(self, depth, logits)

    def verify(drafts, target_argmax):
        targets.append(int(target_argmax[0, 0]))
        return verify_greedy(drafts, target_argmax)

    drafter_module.Drafter.greedy_pick, engine_module.verify_greedy = pick, verify
    spec = {"model": args.head, "method": "eagle3", "num_speculative_tokens": 1, "parallel_drafting": True}
    engine = LLMEngine.from_pretrained(None, spec, max_num_seqs=1, device="cpu", speculation_policy="fixed")
    print(f"| set | steps | {' | '.join(f'in top {k}' for k in TOPS)} |")
    print(f"|---|---:|{'---:|' * len(TOPS)}")
    for dataset in ("humaneval", "mtbench"):
        ranked.clear()
        targets.clear()
        for prompt in load_dataset(dataset)[:args.num_prompts]:
            engine.generate([prompt.chat_messages()], SamplingParams(max_tokens=args.max_tokens), chat=True)
        hits = [sum(int(t in r[:k]) for r, t in zip(ranked, targets)) / len(targets) for k in TOPS]
        print(f"| {dataset} | {len(targets)} | {' | '.join(f'{h:.3f}' for h in hits)} |")


if __name__ == "__main__":
    main()
