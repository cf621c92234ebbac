"""The draft vocabulary (docs/design.md, "Drafter"): the Vd most frequent supervised tokens, sorted by id.

    used[i]   target id of draft id i (ascending)
    d2t[i]  = used[i] - i          (int64, length Vd): target id = draft id + d2t[draft id]
    t2d[t]  = t in used            (bool, length V)
"""
from __future__ import annotations

from typing import Iterable

import torch


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


def used_ids(d2t: torch.Tensor) -> torch.Tensor:
    return d2t + torch.arange(d2t.numel(), device=d2t.device)
