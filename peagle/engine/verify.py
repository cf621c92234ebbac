"""Verification: which drafted tokens the target accepts, and the token it adds after them
(docs/design.md, "Decoding step").

Drafts are greedy, so the draft distribution is one-hot. Under that proposal the rejection sampler reduces to:
accept d_i with probability p_i(d_i); on the first rejection sample from p_i with d_i removed and renormalised;
after K accepts sample the bonus token from p_K. The emitted sequence is then distributed exactly as sampling
from the target one token at a time.
"""
from __future__ import annotations

import torch


def verify_greedy(drafts: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, K], target_argmax [B, K+1] -> (num_accepted [B], emitted [B, K+1]).

    Row b emits drafts[b, :a] followed by target_argmax[b, a] (the correction, or the bonus when a == K);
    emitted[b, a+1:] is padding.
    """
    matches = (drafts == target_argmax[:, :-1]).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    emitted = target_argmax.clone()  # accepted drafts equal the argmax, so the argmax row *is* the emission
    return num_accepted, emitted


def verify_sampled(drafts: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """One row: drafts [K], probs [K+1, V] (processed target distribution at each verified position).
    Returns the emitted tokens: the accepted drafts, then one corrected or bonus token."""
    k = drafts.shape[0]
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    out: list[int] = []
    for i in range(k):
        d = int(drafts[i])
        p_d = float(probs[i, d])
        if float(uniforms[i]) < p_d:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
