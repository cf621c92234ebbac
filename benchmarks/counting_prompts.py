"""Prompts for a narrow task whose answers a head can learn in minutes: counting (docs/benchmarks.md, "A head that
accepts a lot"). Training and benchmark prompts use disjoint number ranges.

    python benchmarks/counting_prompts.py --out runs/counting     # train.jsonl (conversations), bench.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from peagle.train.data import PLACEHOLDER_ANSWER

TEMPLATES = ("Count from {a} to {b}.", "List the numbers from {a} to {b}, one per line.",
             "Write the numbers from {a} to {b}, separated by commas.", "Count down from {b} to {a}.")


def prompts(n: int, low: int, high: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a = rng.randrange(low, high)
        out.append(TEMPLATES[i % len(TEMPLATES)].format(a=a, b=a + rng.randrange(30, 60)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-train", type=int, default=192)
    ap.add_argument("--num-bench", type=int, default=16)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for i, p in enumerate(prompts(args.num_train, 1, 500, seed=0)):
            f.write(json.dumps({"id": f"count-{i}", "messages": [{"role": "user", "content": p}, {
                "role": "assistant", "content": PLACEHOLDER_ANSWER}]}) + "\n")
    with open(out / "bench.jsonl", "w") as f:
        for i, p in enumerate(prompts(args.num_bench, 600, 900, seed=1)):
            f.write(json.dumps({"id": f"count-bench-{i}", "prompt": p}) + "\n")


if __name__ == "__main__":
    main()
