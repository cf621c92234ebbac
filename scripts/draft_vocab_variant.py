"""A trained head with another draft vocabulary, for measuring whether the vocabulary limits acceptance
(docs/heads.md, "The draft vocabulary is not what limits acceptance").

The layers stay; the LM head gets the rows of the new vocabulary: a token the head already had keeps its trained row,
a new token gets the target's row through the linear map that best takes the target's rows to the head's trained ones
(least squares with a bias; the trained rows have drifted from the target's, and raw target rows would outscore them
everywhere). The vocabulary is chosen from how often each token is an answer token in conversation files:

    python3 scripts/draft_vocab_variant.py --head runs/campaign/rounds/rows-009600-010800/peagle \
        --data data/heads/smollm2-regenerated-*.jsonl.gz --mode reselect --size 8192 --out runs/vocab/reselect-8k
    python3 scripts/draft_vocab_variant.py --head ... --data ... --mode add --size 16384 --out runs/vocab/add-16k

--mode reselect: the `size` most frequent answer tokens; --mode add: every token of the head's vocabulary plus the
most frequent others up to `size`. Every 20th conversation is left out of the counts, and the coverage of its answer
tokens is printed for the head's vocabulary and the new one.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from peagle.model.loading import load_tokenizer, resolve_model
from peagle.model.target import TargetModel
from peagle.train.data import open_text
from peagle.train.vocab import mapping, select_draft_vocab, used_ids


def answer_token_counts(files: list[str], tokenizer, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts over the kept conversations, counts over every 20th one) of assistant-message tokens."""
    kept, left_out = torch.zeros(vocab_size, dtype=torch.long), torch.zeros(vocab_size, dtype=torch.long)
    for f in files:
        with open_text(f) as fh:
            for k, line in enumerate(fh):
                for m in json.loads(line)["messages"]:
                    if m["role"] == "assistant" and m["content"]:
                        ids = torch.tensor(tokenizer(m["content"])["input_ids"], dtype=torch.long)
                        (left_out if k % 20 == 0 else kept).index_add_(0, ids, torch.ones_like(ids))
    return kept, left_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="a trained head folder")
    ap.add_argument("--data", nargs="+", required=True, help="conversation files (.jsonl or .jsonl.gz)")
    ap.add_argument("--mode", choices=("reselect", "add"), required=True)
    ap.add_argument("--size", type=int, required=True, help="rows of the new vocabulary")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default=None, help="the head's target [the embedded SmolLM2-135M-Instruct]")
    args = ap.parse_args()

    src, out = Path(args.head), Path(args.out)
    weights = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    model_dir = resolve_model(args.target)
    target = TargetModel.from_pretrained(model_dir, dtype=torch.bfloat16)
    rows_of_target = target.output_embeddings().detach().float()
    counts, left_out = answer_token_counts(args.data, load_tokenizer(model_dir), rows_of_target.shape[0])
    old = used_ids(weights["d2t"])
    score = counts.double()
    if args.mode == "add":
        score[old] = float("inf")
    mask = [cfg["mask_token_id"]] if cfg.get("mask_token_id") is not None else []
    new = select_draft_vocab(score, args.size, exclude=mask)

    trained = weights["lm_head.weight"].float()
    with_bias = lambda x: torch.cat([x, torch.ones(x.shape[0], 1)], 1)  # noqa: E731
    fit = torch.linalg.lstsq(with_bias(rows_of_target[old]), trained).solution
    rows = with_bias(rows_of_target[new]) @ fit
    kept = torch.isin(new, old)  # both vocabularies are ascending target ids
    rows[kept] = trained[torch.searchsorted(old, new[kept])]
    weights["d2t"], weights["t2d"] = mapping(new, rows_of_target.shape[0])
    weights["lm_head.weight"] = rows.to(weights["lm_head.weight"].dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": args.size}, indent=1) + "\n")
    for name in ("training_args.json", "eval.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    total = int(left_out.sum())
    n_kept = int(kept.sum())
    print(f"{out}: {args.size} rows ({n_kept} trained rows kept, {args.size - n_kept} mapped from the target's); "
          f"answer-token coverage of the left-out conversations: head's vocabulary {left_out[old].sum() / total:.4f}, "
          f"new {left_out[new].sum() / total:.4f} ({total} tokens)")


if __name__ == "__main__":
    main()
