"""Drafters behind one interface (base.Proposer): the heads, prompt lookup, suffix trees, and the hybrid that picks
between a head and the suffix tree per request and step (docs/design.md, "Decoding step")."""
from __future__ import annotations

from typing import TYPE_CHECKING

from peagle.engine.acceptance import Draft
from peagle.engine.proposers.base import NullProposer, Proposer

if TYPE_CHECKING:
    from peagle.config import SpeculativeConfig
    from peagle.engine.policy import SpeculationPolicy
    from peagle.engine.proposers.heads import HeadProposer

__all__ = ["Draft", "NullProposer", "Proposer", "make_proposer"]


def make_proposer(spec: "SpeculativeConfig | None", head: "HeadProposer | None", policy: "SpeculationPolicy",
                  side_leaves: bool = False) -> Proposer:
    """The proposer a speculative config names (`head`: the loaded head's, for the methods that draft with one;
    no config: NullProposer); `side_leaves`: suffix drafts carry their tree's other continuations for draft
    trees."""
    if spec is None:
        return NullProposer()
    if spec.method == "ngram":
        from peagle.engine.proposers.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        from peagle.engine.proposers.suffix import SuffixProposer

        return SuffixProposer(spec, spec.num_speculative_tokens, side_leaves)
    assert head is not None, f"method {spec.method!r} drafts with a head"
    if spec.method == "hybrid":
        from peagle.engine.proposers.hybrid import HybridProposer
        from peagle.engine.proposers.suffix import SuffixProposer

        return HybridProposer(head, SuffixProposer(spec, spec.suffix_decoding_max_tree_depth, side_leaves), policy)
    return head
