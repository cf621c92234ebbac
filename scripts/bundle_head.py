"""Copy a trained head into peagle/heads/NAME in the compact form the package ships: bf16, and for P-EAGLE only the
learned mask-token row of the embedding table (loading takes every other row from the embedded target;
`peagle export` writes the full table vLLM wants), unless training changed other rows too (--train-embeddings). Keeps a 2-layer P-EAGLE and a 1-layer EAGLE-3 head at draft
vocab 8192 under 60 MB together.

    python scripts/bundle_head.py runs/peagle-head smollm2-135m-peagle
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from peagle.model.checkpoint import load_head, save_head
from peagle.model.heads import HEADS_DIR
from peagle.model.loading import embedded_model_dir
from peagle.model.export import target_embeddings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("head", help="a trained head folder (the output of `peagle train`)")
    ap.add_argument("name", help="the bundled name, e.g. smollm2-135m-peagle")
    args = ap.parse_args()
    src, out = Path(args.head), HEADS_DIR / args.name
    table = target_embeddings(embedded_model_dir())
    head = load_head(src, target_embeddings=table, dtype=torch.bfloat16)
    # A head trained with --train-embeddings changed rows besides the mask token's: it must ship its whole table.
    changed = head.embed_tokens.weight != table.to(torch.bfloat16)
    if head.config.mask_token_id is not None:
        changed[head.config.mask_token_id] = False
    if out.exists():
        shutil.rmtree(out)
    save_head(head, out, include_embeddings=bool(changed.any()), dtype=torch.bfloat16)
    for extra in ("eval.json", "training_args.json"):  # how it was made and what it scored, kept beside it
        if (src / extra).exists():
            shutil.copy(src / extra, out / extra)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2 ** 20
    cfg = json.loads((out / "config.json").read_text())
    print(f"bundled {src} as {out} ({size:.1f} MiB, {cfg['num_hidden_layers']} layer(s), draft vocab "
          f"{cfg['draft_vocab_size']})")


if __name__ == "__main__":
    main()
