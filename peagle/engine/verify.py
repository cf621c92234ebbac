"""Verification: which drafted tokens the target accepts, and the token it adds after them
(docs/design.md, "Decoding step" and "Draft trees").

Drafts are chosen without randomness (a head's best tokens), so a node's draft distribution is one-hot. Under such
proposals the rejection sampler reduces to: accept d with probability p(d); on a rejection, try the next sibling
under p with d removed and renormalised, and when no child is left sample from what remains; after the last
accepted node sample the bonus token from its p. The emitted sequence is then distributed exactly as sampling from
the target one token at a time. A chain (one child per node) is the textbook rule.
"""
from __future__ import annotations

import torch

from peagle.engine.draft_tree import DraftTree


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], list[int]]:
    """The accepted path (node indices) and the emitted tokens: the path's tokens and then the target's own, where
    target_argmax[0] is the target's token after x_n and target_argmax[1 + i] after node i."""
    path, row = [], 0
    while True:
        want = target_argmax[row]
        nxt = next((c for c in tree.children[path[-1] if path else -1] if tree.tokens[c] == want), None)
        if nxt is None:
            return path, [tree.tokens[i] for i in path] + [want]
        path.append(nxt)
        row = nxt + 1


def verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None
                   ) -> tuple[list[int], list[int]]:
    """As verify_greedy for sampling, probs [1 + len(tree), V] the target's processed distributions. At each
    node its children are tried in order (SpecInfer's rule for drafts chosen without randomness): child c is
    accepted with probability r(c) / sum(r), r the target's distribution less the children already rejected; when
    every child is rejected the token is drawn from what r has left. The emitted token is thus distributed exactly
    as the target's: P(c) = r(c) at every try."""
    uniforms = torch.rand(len(tree), generator=generator, device=probs.device)
    path: list[int] = []
    while True:
        row = path[-1] + 1 if path else 0
        residual, nxt = None, None
        for c in tree.children[path[-1] if path else -1]:
            token = tree.tokens[c]
            if residual is None:
                accept = float(uniforms[c]) < float(probs[row, token])
                residual = probs[row]
            else:
                accept = float(uniforms[c]) < float(residual[token] / residual.sum())
            if accept:
                nxt = c
                break
            residual = residual.clone()
            residual[token] = 0.0
        if nxt is None:
            dist = probs[row] if residual is None else residual / residual.sum()
            token = int(torch.multinomial(dist, 1, generator=generator))
            return path, [tree.tokens[i] for i in path] + [token]
        path.append(nxt)
