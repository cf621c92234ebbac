"""Join regenerated conversation files into one training file, keeping a fixed held-out set apart: the conversations
the bundled heads were evaluated on (`peagle train`'s 2% split of data/heads/smollm2-regenerated.jsonl.gz, seed 0), so
that a head trained on more data is measured on the same held-out rows as the bundled ones (docs/heads.md).

    python3 scripts/split_head_data.py --inputs data/heads/smollm2-regenerated.jsonl.gz runs/r14b/regen/regenerated.jsonl \\
        --train runs/r14b/train.jsonl --heldout runs/r14b/heldout.jsonl

Inputs and outputs may be gzip-compressed (a `.gz` name); the outputs' lines are the inputs' lines, unchanged.
"""
from __future__ import annotations

import argparse
import json

from peagle.train.data import iter_json_records, open_text
from peagle.train.trainer import TrainConfig, heldout_split

BUNDLED_DATA = "data/heads/smollm2-regenerated.jsonl.gz"


def bundled_heldout_ids(path: str = BUNDLED_DATA) -> set[str]:
    """The ids `peagle train` held out of the bundled data (its split with the defaults the heads were trained
    with)."""
    ids = [rec["id"] for rec in iter_json_records(path)]
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
    with open_text(args.train, "w") as train, open_text(args.heldout, "w") as heldout:
        for path in args.inputs:
            with open_text(path) as lines:
                for line in lines:
                    if not line.strip():
                        continue
                    conv_id = json.loads(line)["id"]
                    if conv_id in seen:
                        raise SystemExit(f"{path}: conversation id {conv_id!r} appears twice across --inputs; "
                                         "number new prompts past the old ones (make_head_prompts.py --first-id)")
                    seen.add(conv_id)
                    split = "heldout" if conv_id in heldout_ids else "train"
                    (heldout if split == "heldout" else train).write(line if line.endswith("\n") else line + "\n")
                    counts[split] += 1
    print(f"{counts['train']} training and {counts['heldout']} held-out conversations")


if __name__ == "__main__":
    main()
