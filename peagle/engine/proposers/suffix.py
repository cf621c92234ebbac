"""Suffix decoding (vLLM's `method: "suffix"`, after Arctic Inference): the draft continues the longest suffix of
the request's context found in a suffix tree over its own prompt and output, or in the shared tree over recent
finished requests' outputs under the same cache key (the tree itself: suffix_tree.py). The tree's counts give each
drafted token a probability; the measured acceptance of this proposer's drafts (policy.MeasuredAcceptance) caps it,
since a path seen once says little, and the policy cuts the draft where a longer window stops paying. Where draft
trees are on (`side_leaves`), each token comes with the other continuations the tree saw there, as side leaves whose
probabilities are measured per rank and count (side_leaves.py)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from peagle.config import TREE_TOP_M
from peagle.engine.acceptance import Draft, MeasuredAcceptance, SideLeaf, survival
from peagle.engine.proposers.base import NoHead
from peagle.engine.proposers.side_leaves import SideLeafAcceptance
from peagle.engine.proposers.suffix_tree import SuffixCache

if TYPE_CHECKING:
    from peagle.config import SpeculativeConfig
    from peagle.engine.request import Request

NAME = "suffix"


class SuffixProposer(NoHead):
    names = (NAME,)

    def __init__(self, spec: "SpeculativeConfig", max_k: int, side_leaves: bool = False):
        """`side_leaves`: its drafts carry the tree's other continuations (acceptance.Draft.leaves)."""
        self.max_k = max_k
        self.alternatives = TREE_TOP_M - 1 if side_leaves else 0
        self.leaf_acceptance = SideLeafAcceptance()
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.cache = SuffixCache(max_tree_depth=spec.suffix_decoding_max_tree_depth,
                                 max_cached_requests=spec.suffix_decoding_max_cached_requests)
        self.acceptance = MeasuredAcceptance(max_k)

    def _sync(self, req: "Request", prompt_upto: int | None = None) -> None:
        """Bring the request's tree up to its committed tokens (with `prompt_upto`: to that much of its prompt),
        starting it on first sight."""
        rid, m = req.request_id, len(req.prompt_ids)
        upto = m if prompt_upto is None else prompt_upto
        have = self.cache.num_tokens(rid)
        if have is None:
            # the shared tree of the request's credential and salt ("/" cannot occur in a cache_key's hex digest)
            self.cache.start_request(rid, req.prompt_ids[:upto], f"{req.cache_key}/{req.cache_salt}")
            have = upto
        elif have < upto:
            self.cache.add_prompt_tokens(rid, req.prompt_ids[have:upto])
            have = upto
        if prompt_upto is None and have - m < len(req.output_ids):
            self.cache.add_tokens(rid, req.output_ids[have - m:])

    def prefill(self, req: "Request") -> None:
        self._sync(req, prompt_upto=req.num_computed)

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        out = []
        for req in reqs:
            self._sync(req)
            found = self.cache.speculate(req.request_id, self.max_k, self.max_spec_factor, self.min_token_prob,
                                         alternatives=self.alternatives)
            measured = self.acceptance.conditional(req.request_id)
            # the tree's probability of each token, capped by how often this proposer's drafts were accepted there
            conditional = [min(p, a) for p, a in zip(found.probs, measured)]
            leaves = tuple(SideLeaf(i, t, rank, count, self.leaf_acceptance.estimate(rank, count, share))
                           for i, others in enumerate(found.others[: len(conditional)])
                           for rank, (t, count, share) in enumerate(others, start=1))
            out.append(Draft(NAME, list(found.tokens[: len(conditional)]), survival(conditional), leaves))
        return out

    def observe(self, req: "Request", draft: Draft, num_drafted: int, num_accepted: int,
                emitted: Sequence[int] = ()) -> None:
        self.acceptance.observe(req.request_id, num_drafted, num_accepted)
        if draft.leaves and emitted:
            self.leaf_acceptance.observe(draft, emitted)

    def add_tokens(self, req: "Request", tokens: list[int]) -> None:
        self._sync(req)

    def cached_bytes(self) -> int:
        return self.cache.memory_bytes()

    def finish(self, req: "Request") -> None:
        rid = req.request_id
        if self.cache.num_tokens(rid) is None:
            return  # its tree was never started
        if req.finish_reason == "abort":
            self.cache.abort_request(rid)
        else:
            self.cache.stop_request(rid)
        self.acceptance.forget(rid)

