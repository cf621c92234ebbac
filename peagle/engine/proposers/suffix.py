"""Suffix decoding (vLLM's `method: "suffix"`, after Arctic Inference): the draft continues the longest suffix of
the request's context found in a suffix tree over its own prompt and output, or in the shared tree over recent
finished requests' outputs under the same cache key (the tree itself: suffix_tree.py). The tree's counts give each
drafted token a probability; the measured acceptance of this proposer's drafts (policy.MeasuredAcceptance) caps it,
since a path seen once says little, and the policy cuts the draft where a longer window stops paying."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from peagle.engine.policy import MeasuredAcceptance
from peagle.engine.proposers.base import Draft, survival
from peagle.engine.proposers.suffix_tree import SuffixCache

if TYPE_CHECKING:
    from peagle.config import SpeculativeConfig
    from peagle.engine.request import Request

NAME = "suffix"


class SuffixProposer:
    names = (NAME,)

    def __init__(self, spec: "SpeculativeConfig", max_k: int):
        self.max_k = max_k
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.cache = SuffixCache(max_tree_depth=spec.suffix_decoding_max_tree_depth,
                                 max_cached_requests=spec.suffix_decoding_max_cached_requests)
        self.acceptance = MeasuredAcceptance(max_k)
        self._prompt_seen: dict[str, int] = {}  # request -> prompt tokens its tree holds
        self._seen: dict[str, int] = {}  # request -> output tokens its tree holds

    def _index_prompt(self, req: "Request", upto: int) -> None:
        """The request's tree holds its prompt up to `upto` (started on first sight)."""
        rid = req.request_id
        have = self._prompt_seen.get(rid)
        if have is None:
            # the shared tree of the request's credential and salt ("/" cannot occur in a cache_key's hex digest)
            self.cache.start_request(rid, req.prompt_ids[:upto], f"{req.cache_key}/{req.cache_salt}")
        elif upto > have:
            self.cache.add_prompt_tokens(rid, req.prompt_ids[have:upto])
        self._prompt_seen[rid] = max(have or 0, upto)

    def _sync(self, req: "Request") -> None:
        """Bring the request's tree up to its committed tokens."""
        self._index_prompt(req, len(req.prompt_ids))
        rid, seen = req.request_id, self._seen.get(req.request_id, 0)
        if len(req.output_ids) > seen:
            self.cache.add_tokens(rid, req.output_ids[seen:])
        self._seen[rid] = max(seen, len(req.output_ids))

    def prefill(self, req: "Request") -> None:
        self._index_prompt(req, req.num_computed)

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        out = []
        for req in reqs:
            self._sync(req)
            found = self.cache.speculate(req.request_id, self.max_k, self.max_spec_factor, self.min_token_prob)
            measured = self.acceptance.conditional(req.request_id)
            # the tree's probability of each token, capped by how often this proposer's drafts were accepted there
            conditional = [min(p, a) for p, a in zip(found.probs, measured)]
            out.append(Draft(NAME, list(found.tokens[: len(conditional)]), survival(conditional)))
        return out

    def observe(self, req: "Request", draft: Draft, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(req.request_id, num_drafted, num_accepted)

    def add_tokens(self, req: "Request", tokens: list[int]) -> None:
        self._sync(req)

    def finish(self, req: "Request") -> None:
        rid = req.request_id
        self._seen.pop(rid, None)
        if self._prompt_seen.pop(rid, None) is None:
            return  # its tree was never started
        if req.finish_reason == "abort":
            self.cache.abort_request(rid)
        else:
            self.cache.stop_request(rid)
        self.acceptance.forget(rid)

