"""Shuffle several prompt files into one with a fixed seed, so that answers made in its order (and a campaign round
cut from them) mix the files' kinds rather than run through one kind at a time.

    python3 scripts/mix_prompts.py --inputs chat.jsonl code.jsonl --seed 0 --out data/heads/prompts-4.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", nargs="+", required=True, help="JSONL conversations, each with a unique id")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lines = [line for path in args.inputs for line in open(path, encoding="utf-8") if line.strip()]
    ids = [json.loads(line)["id"] for line in lines]
    if len(set(ids)) != len(ids):
        sys.exit("mix_prompts: the inputs share conversation ids; give each file its own --first-id")
    random.Random(args.seed).shuffle(lines)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in lines)
    print(f"mix_prompts: {len(lines)} conversations from {len(args.inputs)} files to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
