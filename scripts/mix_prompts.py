"""Shuffle several prompt files into one with a fixed seed, so that answers made in its order (and a campaign round
cut from them) mix the files' kinds rather than run through one kind at a time.

    python3 scripts/mix_prompts.py --inputs chat.jsonl code.jsonl --seed 0 --out data/heads/prompts-4.jsonl.gz

Inputs and output may be gzip-compressed (a `.gz` name); the output's lines are the inputs' lines, unchanged.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

from peagle.train.data import open_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", nargs="+", required=True,
                    help="JSONL (or .jsonl.gz) conversations, each with a unique id")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lines = []
    for path in args.inputs:
        with open_text(path) as f:
            lines += [line for line in f if line.strip()]
    ids = [json.loads(line)["id"] for line in lines]
    if len(set(ids)) != len(ids):
        sys.exit("mix_prompts: the inputs share conversation ids; give each file its own --first-id")
    random.Random(args.seed).shuffle(lines)
    with open_text(args.out, "w") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in lines)
    print(f"mix_prompts: {len(lines)} conversations from {len(args.inputs)} files to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
