"""The hybrid: per request and step, the suffix tree's draft or the head's, whichever the speculation policy expects
to pay more (its `value`: the best window's expected tokens per second over a plain step's, from the window costs it
measured, the head's measured acceptance and the suffix draft's own probabilities; the suffix draft wherever no head
window beats a plain step), or none, when the policy then finds that no window pays. Text that repeats (code edits, quotes, resent turns) gets the suffix tree's long drafts;
fresh text gets the head's. Where draft trees are on, a head window's candidates carry the suffix draft it beat
(`beside`): the tree shaper grafts its branches onto the head's tree as far as they pay."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from peagle.engine.acceptance import Candidate, Draft
from peagle.engine.proposers.heads import HeadProposer
from peagle.engine.proposers.suffix import SuffixProposer

if TYPE_CHECKING:
    import torch

    from peagle.engine.policy import SpeculationPolicy
    from peagle.engine.request import Request


class HybridProposer:
    def __init__(self, head: HeadProposer, suffix: SuffixProposer, policy: "SpeculationPolicy"):
        self.head, self.suffix, self.policy = head, suffix, policy
        self.names, self.head_name = head.names + suffix.names, head.head_name
        self.beaten: dict[str, Draft] = {}  # this step's suffix drafts that lost to the head, by request

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        out: list[Draft | None] = []
        self.beaten = {}
        for req, draft in zip(reqs, self.suffix.score(reqs)):
            if not draft.tokens:
                out.append(None)
                continue
            remaining = req.params.max_tokens - len(req.output_ids)
            head = self.policy.value(Candidate(req.request_id, remaining), len(reqs))
            # where no head window beats a plain step the suffix draft stays, even a poor one: the policy's probe
            # then re-measures the free draft rather than run the drafter for a head expected not to pay
            if head <= 1.0 or self.policy.value(Candidate(req.request_id, remaining, draft), len(reqs)) >= head:
                out.append(draft)
            else:
                out.append(None)
                self.beaten[req.request_id] = draft
                self.suffix.observe(req, draft, 0, 0)  # not verified: its estimate ages
        return out

    def draft(self, reqs: list["Request"], slots: "torch.Tensor", k: int, top: int = 0, grammars=()):
        drafts, candidates = self.head.draft(reqs, slots, k, top, grammars)
        if candidates is not None:
            beaten = [self.beaten.get(r.request_id) for r in reqs]
            candidates = [c if d is None else dataclasses.replace(c, beside=d.branches(len(d.tokens)))
                          for c, d in zip(candidates, beaten)]
        return drafts, candidates

    def observe(self, req: "Request", draft: Draft, num_drafted: int, num_accepted: int,
                emitted: Sequence[int] = ()) -> None:
        self.suffix.observe(req, draft, num_drafted, num_accepted, emitted)

    def prefill(self, req: "Request") -> None:
        self.suffix.prefill(req)

    def add_tokens(self, req: "Request", tokens: list[int]) -> None:
        self.suffix.add_tokens(req, tokens)

    def finish(self, req: "Request") -> None:
        self.suffix.finish(req)

    def cached_bytes(self) -> int:
        return self.suffix.cached_bytes()
