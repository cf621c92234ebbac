"""What the proposers and the speculation policy both know about drafts: a model-free draft with the probability
that each of its prefixes is accepted, a request as the policy sees it, and the measured acceptance per draft
position that both keep (the policy for the head, each model-free proposer for its own drafts). A leaf: the
proposers and the policy import it, never each other's internals."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

REQUEST_MEMORY = 0.7  # per-request counts keep this much weight per new observation (about 3 steps' memory)
PLAIN_STEP_MEMORY = 0.9  # ... and per step a position is not tried: back to the engine-wide estimate in ~10
ENGINE_MEMORY = 0.98  # engine-wide counts: about 50 observations
REQUEST_PRIOR_WEIGHT = 4.0  # the engine-wide estimate counts as this many observations in a request's estimate
INITIAL_ACCEPTANCE = 0.5  # before anything is seen: optimistic enough that the first steps draft and learn
INITIAL_WEIGHT = 0.5  # but weak: a few observations outweigh it
SURPRISE_SCALE = 2.0  # how fast a request's own contrary evidence overrides the engine-wide prior (z² units)


@dataclass(frozen=True)
class SideLeaf:
    """Another continuation a model-free proposer saw where its draft has `tokens[position]`: a draft tree may verify
    it beside that token, below the ones before it."""
    position: int
    token: int
    rank: int  # 1: the most frequent continuation after the draft's own, 2: the next, ..
    count: int  # how often the proposer saw it there
    accept: float  # the measured probability that the target's token there is this one, given the draft's before


@dataclass(frozen=True)
class Draft:
    """A model-free draft, made before the step's windows are chosen."""
    proposer: str  # who made it: "ngram" or "suffix"
    tokens: list[int]
    survival: list[float]  # survival[i]: the expected probability that tokens[: i + 1] are all accepted
    leaves: tuple[SideLeaf, ...] = ()  # other continuations beside its tokens (none: a chain only)

    @property
    def score(self) -> float:
        """Expected accepted tokens if the whole draft is verified."""
        return sum(self.survival)

    def branches(self, depth: int) -> list[tuple[tuple[int, ...], float]]:
        """The draft's first `depth` tokens and the side leaves beside them as branches (their tokens from the
        root) with the probability that each is accepted, most probable first and every branch after its parent:
        what a draft tree may take from it (draft_tree.TreeShaper.grow)."""
        out = [(tuple(self.tokens[: i + 1]), s) for i, s in enumerate(self.survival[:depth])]
        out += [((*self.tokens[: leaf.position], leaf.token),
                 (self.survival[leaf.position - 1] if leaf.position else 1.0) * leaf.accept)
                for leaf in self.leaves if leaf.position < depth]
        return sorted(out, key=lambda branch: (-branch[1], len(branch[0])))


@dataclass
class Candidate:
    """One request as the policy sees it: its id, how many tokens it may still emit, and the model-free draft a
    proposer already made for it this step (None: the head drafts, if any)."""
    request_id: str
    remaining: int
    draft: Draft | None = None



def survival(conditional: Sequence[float]) -> list[float]:
    """s_i = a_1 * ... * a_i: the probability that the first i drafts are all accepted, from each position's
    acceptance given that those before it were."""
    out, s = [], 1.0
    for a in conditional:
        s *= a
        out.append(s)
    return out


class AcceptanceEstimate:
    """Conditional acceptance per draft position, from exponentially forgotten counts.

    Position i is *tried* in a step when the window reached it and positions 1..i-1 were accepted; a_i is accepted
    over tried. A request's estimate shrinks its own few recent observations towards the engine-wide estimate,
    which counts as REQUEST_PRIOR_WEIGHT observations for as long as the request's data agree with it: a couple of
    unlucky drafts must not switch speculation off where the head is as good as ever (three steps of memory are
    too few to tell luck from a change). When they disagree beyond chance (z² = t (a/t - p)² / p(1 - p) large),
    the prior's weight shrinks by exp(-z² / SURPRISE_SCALE) and the request follows its own data: a change of text
    shows within a few steps. The engine-wide estimate's prior for a position never tried is the estimate of the
    position before it."""

    def __init__(self, max_k: int, memory: float, prior: "AcceptanceEstimate | None" = None):
        self.memory, self.prior = memory, prior
        self.tried = [0.0] * max_k
        self.accepted = [0.0] * max_k
        self.prior_weight = [REQUEST_PRIOR_WEIGHT if prior is not None else INITIAL_WEIGHT] * max_k

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        tried = min(num_accepted + 1, num_drafted)
        for i in range(len(self.tried)):
            if i < tried:
                self.tried[i] = self.memory * self.tried[i] + 1.0
                self.accepted[i] = self.memory * self.accepted[i] + (1.0 if i < num_accepted else 0.0)
                if self.prior is None:  # a request's prior keeps its weight: see the class docstring
                    self.prior_weight[i] *= self.memory
            else:
                self._age(i)

    def age(self) -> None:
        """A plain step: nothing is tried."""
        for i in range(len(self.tried)):
            self._age(i)

    def _age(self, i: int) -> None:
        """Position i was not tried: its evidence fades and the prior's weight returns, so an estimate that fell
        during a bad stretch does not stay frozen at its worst (a position that is never tried cannot correct
        itself). A request's drifts back to the engine-wide estimate; the engine-wide one, more slowly, to its
        position before it, so a deep position written off early (a few unlucky drafts while everything was cold)
        is tried again once the shallower ones prove good."""
        m, weight = (PLAIN_STEP_MEMORY, REQUEST_PRIOR_WEIGHT) if self.prior is not None else (ENGINE_MEMORY,
                                                                                              INITIAL_WEIGHT)
        self.tried[i] *= m
        self.accepted[i] *= m
        self.prior_weight[i] = m * self.prior_weight[i] + (1 - m) * weight

    def conditional(self) -> list[float]:
        prior = self.prior.conditional() if self.prior is not None else None
        out: list[float] = []
        for i, (a, t, w) in enumerate(zip(self.accepted, self.tried, self.prior_weight)):
            p = prior[i] if prior is not None else out[i - 1] if i else INITIAL_ACCEPTANCE
            if prior is not None and t > 0:  # the prior yields to evidence that contradicts it (a change of text)
                z2 = t * (a / t - p) ** 2 / max(p * (1 - p), 0.01)
                w *= math.exp(-z2 / SURPRISE_SCALE)
            out.append((a + w * p) / (t + w))
        return out

    def survival(self) -> list[float]:
        """s_i: the probability that the first i drafts are all accepted."""
        return survival(self.conditional())


class MeasuredAcceptance:
    """One drafter's acceptance per draft position: each request's recent drafts (REQUEST_MEMORY), shrunk towards the
    drafter's engine-wide record (ENGINE_MEMORY) as AcceptanceEstimate describes. The adaptive policy keeps one for
    the head; each model-free proposer (n-gram, suffix) one for its own drafts, so a proposer whose drafts stop
    matching the target's text gets short windows, then none, within a few steps, and drafts again as it
    recovers."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.engine_wide = AcceptanceEstimate(max_k, ENGINE_MEMORY)
        self.requests: dict[str, AcceptanceEstimate] = {}

    def estimate(self, request_id: str) -> AcceptanceEstimate:
        est = self.requests.get(request_id)
        if est is None:
            est = self.requests[request_id] = AcceptanceEstimate(self.max_k, REQUEST_MEMORY, prior=self.engine_wide)
        return est

    def conditional(self, request_id: str) -> list[float]:
        """a_i: the probability that draft position i is accepted given that those before it were."""
        return self.estimate(request_id).conditional()

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verified draft; num_drafted 0: none was verified this step, and the request's estimate ages."""
        est = self.estimate(request_id)
        if num_drafted:
            est.observe(num_drafted, num_accepted)
            self.engine_wide.observe(num_drafted, num_accepted)
        else:
            est.age()

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
