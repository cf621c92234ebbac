"""How often a suffix draft's side leaves (the other continuations its tree saw: acceptance.SideLeaf) turn out to be
the target's token, measured live per rank and count, as the tree shaper calibrates a head's probabilities per
depth: the tree's share of a continuation says little by itself (text seen twice need not repeat).

A leaf is *tried* when the target's tokens reached its position along the draft, whatever was verified: the target's
token there is then known (the token after the accepted ones), so every chain drafted measures its leaves too, and
the rule that decides whether leaves pay is not starved while it picks chains. Before any evidence a leaf's estimate
is its share of the continuations seen there, weighted as PRIOR_WEIGHT observations.
"""
from __future__ import annotations

from collections.abc import Sequence

from peagle.engine.acceptance import ENGINE_MEMORY, Draft

PRIOR_WEIGHT = 1.0
MAX_RANK = 3  # ranks past it share the last class
MAX_COUNT_CLASS = 3  # counts 1, 2-3, 4-7, 8 and more


def leaf_class(rank: int, count: int) -> tuple[int, int]:
    return min(rank, MAX_RANK), min(count.bit_length() - 1, MAX_COUNT_CLASS)


class SideLeafAcceptance:
    """Engine-wide, exponentially forgotten (ENGINE_MEMORY) counts of tried and accepted leaves per class."""

    def __init__(self) -> None:
        self.tried: dict[tuple[int, int], float] = {}
        self.accepted: dict[tuple[int, int], float] = {}

    def estimate(self, rank: int, count: int, share: float) -> float:
        """The probability that a leaf of this rank and count is the target's token where its position is reached."""
        c = leaf_class(rank, count)
        return (self.accepted.get(c, 0.0) + PRIOR_WEIGHT * share) / (self.tried.get(c, 0.0) + PRIOR_WEIGHT)

    def observe(self, draft: Draft, emitted: Sequence[int]) -> None:
        """A step's outcome for a request that had `draft`: `emitted`, the tokens it committed (the accepted ones,
        then the target's own)."""
        reached = 0  # how far the emitted tokens follow the draft
        while reached < min(len(draft.tokens), len(emitted)) and emitted[reached] == draft.tokens[reached]:
            reached += 1
        for leaf in draft.leaves:
            if leaf.position <= reached and leaf.position < len(emitted):
                c = leaf_class(leaf.rank, leaf.count)
                self.tried[c] = ENGINE_MEMORY * self.tried.get(c, 0.0) + 1.0
                self.accepted[c] = ENGINE_MEMORY * self.accepted.get(c, 0.0) + (emitted[leaf.position] == leaf.token)
