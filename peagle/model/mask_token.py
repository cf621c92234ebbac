"""P-EAGLE's mask token: an id the target's tokenizer never produces in chat, whose embedding row the head learns
as the token input of every mask slot (docs/design.md, "Drafter"). Training, `peagle export --random-init` and
`peagle bench --random-heads` all pick it here."""
from __future__ import annotations

import torch


def choose_mask_token_id(tokenizer, vocab_size: int, token_counts: torch.Tensor | None = None) -> int:
    """The mask token for a target with `vocab_size` embedding rows.

    In order: the lowest special added token that is not bos/eos/pad/unk, not in the chat template and never seen
    in `token_counts` (SmolLM2: id 3, `<repo_name>`); an embedding row past the tokenizer's vocabulary; without a
    tokenizer, the highest id the data never uses. Raises ValueError (naming `--mask-token-id`) when none is free."""
    seen = (token_counts[:vocab_size] > 0) if token_counts is not None else torch.zeros(vocab_size, dtype=torch.bool)
    if tokenizer is not None:
        in_use = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
        in_use |= _chat_template_ids(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        for tid in sorted(added):
            if getattr(added[tid], "special", False) and tid < vocab_size and tid not in in_use and not seen[tid]:
                return int(tid)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
    elif token_counts is not None:
        unseen = torch.nonzero(~seen).flatten()
        if unseen.numel():
            return int(unseen[-1])
    raise ValueError("no token id is free for the P-EAGLE mask token (every special token is used by the chat "
                     "template or the data, and the tokenizer covers every embedding row): pass --mask-token-id ID, "
                     "an id the tokenizer never produces")


def _chat_template_ids(tokenizer) -> set[int]:
    """The ids a rendered two-turn chat uses: the template's own special tokens are real inputs, not free ids."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}], tokenize=False)
    except Exception:  # noqa: BLE001 - no chat template, or one that rejects this chat: nothing to exclude
        return set()
    return set(tokenizer(text, add_special_tokens=False)["input_ids"])
