"""The draft vocabulary (DESIGN section 2): the Vd most frequent supervised tokens, sorted by id.

    used[i]   target id of draft id i (ascending)
    d2t[i]  = used[i] - i          (int64, length Vd): target id = draft id + d2t[draft id]
    t2d[t]  = t in used            (bool, length V)
"""
from __future__ import annotations

from typing import Iterable

import torch


def count_supervised(rows: Iterable[dict], vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a supervised (assistant) token."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        ids = torch.as_tensor(r["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(r["loss_mask"], dtype=torch.bool)
        sup = ids[mask]
        if sup.numel():
            if int(sup.max()) >= vocab_size:
                raise ValueError(f"token id {int(sup.max())} is outside the target's vocabulary ({vocab_size}); "
                                 "was the data prepared with another tokenizer?")
            counts += torch.bincount(sup, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, exclude: Iterable[int] = ()) -> torch.Tensor:
    """Target ids of the draft vocab, ascending: the most frequent supervised tokens; when fewer distinct tokens were
    seen than Vd, the rest is filled with the lowest unseen ids (ties broken by lower id)."""
    V = counts.numel()
    if not 1 <= draft_vocab_size <= V:
        raise ValueError(f"draft vocab size must be between 1 and the target's vocab size {V}, got {draft_vocab_size}")
    score = counts.double().clone()
    # Stable tie-break toward lower ids: subtract a tiny id-proportional amount from every score.
    score -= torch.arange(V, dtype=torch.double) / (2.0 * V)
    for e in exclude:
        if 0 <= e < V:
            score[e] = float("-inf")
    used = torch.topk(score, draft_vocab_size).indices
    return torch.sort(used).values


def mapping(used: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for ascending target ids `used`."""
    used = used.long()
    if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
        raise ValueError("draft vocab ids must be strictly ascending")
    d2t = used - torch.arange(used.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Draft ids of target ids (-1 where the target id is not in the draft vocab)."""
    index = torch.cumsum(t2d.long(), 0) - 1
    return torch.where(t2d[target_ids], index[target_ids], torch.full_like(target_ids, -1))


def used_ids(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), device=d2t.device)
