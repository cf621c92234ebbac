"""Join regenerated conversation files into one training file, keeping a fixed held-out set apart: the conversations
the bundled heads were evaluated on (`peagle train`'s 2% split of data/heads/smollm2-regenerated.jsonl, seed 0), so
that a head trained on more data is measured on the same held-out rows as the bundled ones (docs/heads.md).

    python3 scripts/split_head_data.py --inputs data/heads/smollm2-regenerated.jsonl runs/r14b/regen/regenerated.jsonl \\
        --train runs/r14b/train.jsonl --heldout runs/r14b/heldout.jsonl
"""
from __future__ import annotations

import argparse
import json

from peagle.train.trainer import TrainConfig, heldout_split

BUNDLED_DATA = "data/heads/smollm2-regenerated.jsonl"


def bundled_heldout_ids(path: str = BUNDLED_DATA) -> set[str]:
    """The ids `peagle train` held out of the bundled data (its split with the defaults the heads were trained
    with)."""
    ids = [json.loads(line)["id"] for line in open(path, encoding="utf-8") if line.strip()]
    heldout, _ = heldout_split(len(ids), TrainConfig.eval_fraction, TrainConfig.seed)
    return {ids[i] for i in heldout}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", nargs="+", required=True, help="regenerated conversations (JSONL)")
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    args = ap.parse_args()
    heldout_ids, seen = bundled_heldout_ids(), set()
    counts = {"train": 0, "heldout": 0}
    with open(args.train, "w", encoding="utf-8") as train, open(args.heldout, "w", encoding="utf-8") as heldout:
        for path in args.inputs:
            for line in open(path, encoding="utf-8"):
                if not line.strip():
                    continue
                conv_id = json.loads(line)["id"]
                if conv_id in seen:
                    raise SystemExit(f"{path}: conversation id {conv_id!r} appears twice across --inputs; number "
                                     "new prompts past the old ones (make_head_prompts.py --first-id)")
                seen.add(conv_id)
                split = "heldout" if conv_id in heldout_ids else "train"
                (heldout if split == "heldout" else train).write(line if line.endswith("\n") else line + "\n")
                counts[split] += 1
    print(f"{counts['train']} training and {counts['heldout']} held-out conversations")


if __name__ == "__main__":
    main()
