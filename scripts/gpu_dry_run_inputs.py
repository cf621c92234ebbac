"""What `scripts/gpu_train.sh --dry-run` packs instead of the real run's inputs: a tiny random Llama target (a model
folder) and a few random prepared rows, training and held-out, so the whole GPU run can be rehearsed on a CPU in
well under two minutes.

    python3 scripts/gpu_dry_run_inputs.py OUT    # writes OUT/target, OUT/data, OUT/heldout
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peagle.train.data import save_rows

VOCAB = 256


def rows(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(48, 97, (1,), generator=g))
        out.append({"id": f"{seed}-{i}", "input_ids": torch.randint(3, VOCAB, (length,), generator=g).tolist(),
                    "loss_mask": [0] * 8 + [1] * (length - 8)})
    return out


def main(out: Path) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out / "target")
    save_rows(rows(32, seed=1), out / "data", {"source": "gpu_train.sh --dry-run"})
    save_rows(rows(4, seed=2), out / "heldout", {"source": "gpu_train.sh --dry-run"})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
