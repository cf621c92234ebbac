"""One decode step as data (docs/design.md, "Decoding step"). The engine plans a step as one `Window` per decoding
request and carries the `StepPlan` through every phase; each field of a window is written once, by its phase:

    plan     `k` the policy's number of drafts, `draft` the proposer's model-free draft, `grammar` a constrained
             request's window on its grammar (a head still behind after catch-up gets a copy with k = 0)
    draft    `tree`: the window's drafts as a draft tree (a chain: one branch), cut to k; the head's or the
             model-free draft's, proposed under the grammar where there is one
    grammar  `forced`: the forced tokens (the only ones a grammar allows) verified after the drafts
    verify   every window [x_n, tokens...] in one target forward
    commit   each window's `Outcome`, the one record every statistic and estimate is derived from
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peagle.engine.draft_tree import DraftTree

if TYPE_CHECKING:
    from peagle.engine.acceptance import Draft
    from peagle.engine.grammar import GrammarWindow
    from peagle.engine.request import Request


@dataclass(eq=False)
class Window:
    """One request's part of a step: what it verifies after its newest token x_n."""
    request: Request
    k: int  # drafts the policy gave it (0: a plain step for this request)
    draft: Draft | None = None  # the model-free draft made before the policy chose (None: the head's, if k)
    grammar: GrammarWindow | None = None  # the request's grammar over this step (None: unconstrained)
    tree: DraftTree = DraftTree.chain([])  # its drafts (a plain window: none)
    forced: tuple[int, ...] = ()  # tokens verified after the drafts: the only ones its grammar allowed

    @property
    def tokens(self) -> list[int]:
        """What it verifies after x_n: its drafts (a tree's nodes in order), then its forced tokens."""
        return [*self.tree.tokens, *self.forced]

    @property
    def drafted(self) -> int:
        return len(self.tree)

    @property
    def branches(self) -> bool:
        """Whether its drafts branch (verified with per-node keys, and the accepted branch moved into place)."""
        return not self.tree.is_chain

    @property
    def by_head(self) -> bool:
        """Whether the head drafts this window (one drafter forward for all such windows)."""
        return self.k > 0 and self.draft is None

    def outcome(self, path: list[int], emitted: list[int], forced: int, head: str | None) -> Outcome:
        """What this window came to: `path` the drafts verification accepted (node indices), `emitted` the tokens
        it accepted and then the target's, `forced` the committed tokens the grammar forced, `head` the name of the
        head's proposer."""
        proposer = self.draft.proposer if self.draft is not None else head
        accepted = min(len(path), self.drafted)
        return Outcome(self.request, self.draft, proposer, self.drafted, accepted, forced, self.tree.depth,
                       self.tree.first_children(path[:accepted]), self.tree, tuple(path[:accepted]),
                       tuple(emitted))


@dataclass
class StepPlan:
    windows: list[Window]

    @property
    def head_windows(self) -> list[Window]:
        return [w for w in self.windows if w.by_head]

    @property
    def head_k(self) -> int:
        """The widest window the head drafts: its one forward drafts this many tokens for every head window."""
        return max((w.k for w in self.windows if w.by_head), default=0)

    @property
    def rows(self) -> int:
        """Rows of the verify forward: x_n and the window's tokens, per request."""
        return sum(1 + len(w.tokens) for w in self.windows)

    @property
    def verifies_forced_tokens(self) -> bool:
        """Whether some window verifies tokens past its drafts (a grammar's forced run)."""
        return any(w.forced for w in self.windows)

    def holding_back(self, requests: set[Request]) -> StepPlan:
        """This plan with the head windows of `requests` made plain (their drafter is still behind: catch_up.py)."""
        return StepPlan([dataclasses.replace(w, k=0) if w.by_head and w.request in requests else w
                         for w in self.windows])


@dataclass(frozen=True)
class Outcome:
    """How one window fared. The request's and the engine's statistics, its proposer's, and what the policy or the
    proposer learn are all derived from this one record (`LLMEngine._record`)."""
    request: Request
    draft: Draft | None  # the model-free draft it was offered, verified or not (its proposer learns either way)
    proposer: str | None  # who drafted (None: no drafter ran)
    drafted: int  # drafts verified: forced tokens verified after them do not count
    accepted: int  # the first `accepted` of them matched the target (a tree's: the accepted branch's length)
    forced: int  # committed tokens that were the only one the grammar allowed
    depth: int  # the deepest draft verified (a chain's: `drafted`)
    chain_accepted: int  # what the tree's first-child chain would have accepted (a chain's: `accepted`)
    tree: DraftTree  # what it verified (the tree shaper calibrates on those whose probabilities it knows)
    path: tuple[int, ...]  # the accepted nodes of `tree`
    emitted: tuple[int, ...]  # the accepted tokens (forced ones included), then the target's
