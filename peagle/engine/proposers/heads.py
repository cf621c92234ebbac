"""The heads' drafts (P-EAGLE: all K in one drafter forward; EAGLE-3: one forward per draft), made after the policy
has chosen the windows, in one batch at the widest of them. On the way the drafter runs every request's real rows it
has not seen (the request's backlog, request.DrafterBacklog): also the rows of steps where another proposer drafted
or the step was plain, so its cache has no gap whenever it drafts again. Under a grammar each depth's draft is the
drafter's best token that the grammar allows (`grammar_pick`). With `beams` an EAGLE-3 head expands a dynamic tree
for draft trees (Drafter.draft_tree); a constrained request expands its chain alone (its window stays a chain)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from peagle.config import TREE_TOP_M
from peagle.engine.acceptance import Draft
from peagle.engine.draft_tree import CandidateTree, Candidates, ExpandedTree, top_candidates
from peagle.engine.proposers.base import NoModelFreeDrafts
from peagle.engine.timing import timed

if TYPE_CHECKING:
    from peagle.engine.grammar import GrammarWindow
    from peagle.engine.request import Request
    from peagle.model.drafter import Drafter


class HeadProposer(NoModelFreeDrafts):
    def __init__(self, drafter: "Drafter", drafter_cache, parallel_drafting: bool, device, beams: int = 0):
        """`beams`: an EAGLE-3 head's draft trees expand that many nodes per depth (0: the chain's side leaves)."""
        self.drafter, self.cache, self.parallel, self.device = drafter, drafter_cache, parallel_drafting, device
        self.beams = 0 if parallel_drafting else beams
        self.name = self.head_name = "peagle" if parallel_drafting else "eagle3"
        self.names = (self.name,)

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        return [None] * len(reqs)  # the head drafts after the windows are chosen

    @property
    def draft_fn(self):
        return self.drafter.draft_parallel if self.parallel else self.drafter.draft_chain

    def draft(self, reqs: list["Request"], slots: torch.Tensor, k: int, top: int = 0,
              grammars: Sequence["GrammarWindow | None"] = ()) -> tuple[torch.Tensor, list[CandidateTree] | None]:
        """Drafts [B, k] as target ids, and with `top` each request's candidates for a draft tree (the `top` best
        per position, or per expanded node); the drafter runs every request's pending real rows on the way. A
        request with a grammar window drafts under its mask (`grammar_pick`) and expands its chain alone."""
        tokens, feats, num_real, start = self.pending_batch(reqs)
        for r in reqs:
            r.backlog.consume()
        pick, seen = self.grammar_pick(grammars) or self.drafter.greedy_pick, []
        if top and self.beams:
            beams = [1 if g is not None else self.beams for g in (grammars or [None] * len(reqs))]
            drafts, trees = self.drafter.draft_tree(tokens, feats, num_real, start, slots, self.cache, k, beams, top,
                                                    pick=pick)
            return drafts, [ExpandedTree(*t) for t in trees]
        if top:
            choose = pick

            def pick(depth: int, logits: torch.Tensor) -> torch.Tensor:
                seen.append(top_candidates(logits, self.drafter.to_target_ids, top))
                return choose(depth, logits)

        drafts = self.draft_fn(tokens, feats, num_real, start, slots, self.cache, k, pick=pick)
        if not seen:
            return drafts, None
        ids, logprobs = (torch.stack(c, 1).tolist() for c in zip(*seen))  # [B, k, top] each
        return drafts, [Candidates(i, lp, free=self.parallel) for i, lp in zip(ids, logprobs)]

    def pending_batch(self, reqs: list["Request"]):
        """Every request's unseen real rows, left-aligned: tokens [B, R], features [B, R, 3Ht], counts, starts."""
        B, dev = len(reqs), self.device
        R = max(len(r.backlog) for r in reqs)
        first = reqs[0].backlog.features()
        tokens = torch.zeros(B, R, dtype=torch.long, device=dev)
        feats = torch.zeros(B, R, first.shape[-1], dtype=first.dtype, device=dev)
        for b, r in enumerate(reqs):
            tokens[b, : len(r.backlog)] = torch.tensor(r.backlog.tokens, device=dev)
            feats[b, : len(r.backlog)] = r.backlog.features()
        num_real = torch.tensor([len(r.backlog) for r in reqs], device=dev)
        start = torch.tensor([r.backlog.start for r in reqs], device=dev)
        return tokens, feats, num_real, start

    def grammar_pick(self, grammars: Sequence["GrammarWindow | None"]):
        """The drafter's choice at each depth when some of the drafting requests are constrained: theirs under the
        mask of the state their earlier drafts reached (each proposal is consumed tentatively by its grammar window,
        and settled when the engine commits), everyone else's greedy. None when no request is constrained."""
        constrained = [(j, g) for j, g in enumerate(grammars) if g is not None]
        if not constrained:
            return None
        draft_to_target = self.draft_to_target

        def pick(depth: int, logits: torch.Tensor) -> torch.Tensor:
            ids = self.drafter.greedy_pick(depth, logits)
            for j, g in constrained:
                token = g.propose(logits[j], draft_to_target)
                if token is not None:
                    ids[j] = token
            return ids

        return pick

    @cached_property
    def draft_to_target(self) -> torch.Tensor:
        """The target id of every draft-vocabulary id."""
        return self.drafter.to_target_ids(torch.arange(self.drafter.config.draft_vocab_size, device=self.device))

    def time_draft(self, batch: int, k: int, context: int, clock: Callable[[], float]) -> float:
        """Seconds of drafting k tokens for `batch` requests (in the first slots, whose entries are scratch before
        any request holds them) at `context` cached positions, with a typical step's two new real rows each."""
        dev, rows = self.device, 2
        slots = torch.arange(batch, device=dev)
        tokens = torch.ones(batch, rows, dtype=torch.long, device=dev)
        feats = torch.zeros(batch, rows, self.drafter.fc.weight.shape[1], dtype=self.drafter.fc.weight.dtype,
                            device=dev)
        num_real = torch.full((batch,), rows, device=dev)
        start = torch.full((batch,), context - rows, device=dev)

        def draft():
            with torch.inference_mode():
                if self.beams:  # the dynamic tree's passes: `beams` rows each after the first
                    self.drafter.draft_tree(tokens, feats, num_real, start, slots, self.cache, k, [self.beams] * batch,
                                            TREE_TOP_M)
                else:
                    self.draft_fn(tokens, feats, num_real, start, slots, self.cache, k)

        return timed(draft, clock)
