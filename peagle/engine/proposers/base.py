"""The seam between the engine and its drafters (docs/design.md, "Decoding step"): every kind of draft is one
module behind the small `Proposer` interface, as vLLM v1 keeps its n-gram, EAGLE and suffix proposers apart.

A step asks the proposer twice. `score` comes before the speculation policy picks each request's window: a
model-free proposer (ngram.py, suffix.py) makes its whole draft there, cheaply, with the probability that each of
its prefixes is accepted, so the policy can cut it to what the window's measured cost pays for. A head (heads.py)
returns None there and drafts in `draft`, once the windows are chosen, in one forward for every window it was
given, since its drafts cost a forward of the drafter. hybrid.py picks, per request and step, between the two.
`NullProposer` is the proposer of an engine that does not speculate: it proposes nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from peagle.engine.acceptance import Draft

if TYPE_CHECKING:
    import torch

    from peagle.engine.draft_tree import CandidateTree
    from peagle.engine.grammar import GrammarWindow
    from peagle.engine.request import Request


class Proposer(Protocol):
    """What the engine asks of a drafter. `names` are the drafters it may run (for the per-proposer counters);
    `head_name` the one that drafts the windows `score` left to a head (None: no head)."""
    names: tuple[str, ...]
    head_name: str | None

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        """Per request this step: a model-free draft (empty: nothing worth proposing), or None where the head
        drafts once the windows are chosen."""
        ...

    def draft(self, reqs: list["Request"], slots: torch.Tensor, k: int, top: int = 0,
              grammars: Sequence[GrammarWindow | None] = ()) -> tuple[torch.Tensor, list[CandidateTree] | None]:
        """The head's drafts [B, k] as target ids for the requests whose windows it was given (in `slots`), and
        with `top` each request's candidates for a draft tree (draft_tree.CandidateTree). A request with a grammar
        window (`grammars`, per request) drafts under its mask: the window holds its drafts."""
        ...

    def observe(self, req: "Request", draft: Draft, num_drafted: int, num_accepted: int,
                emitted: Sequence[int] = ()) -> None:
        """How the request's model-free draft fared: `num_drafted` of it verified (0: the policy ran a plain step
        or the head instead), the first `num_accepted` accepted (a draft tree's: its draft's own tokens, the
        tree's first children), and `emitted` the tokens the step committed (the accepted, then the target's)."""
        ...

    def prefill(self, req: "Request") -> None:
        """The request's prompt is computed up to `req.num_computed`: a proposer that indexes prompts may take that
        much now, so a long prompt's index is built a chunk a step, under the step's time budget, rather than in
        one piece at its first decode step."""
        ...

    def add_tokens(self, req: "Request", tokens: list[int]) -> None:
        """Tokens the request just committed. A proposer that has not seen the request yet starts it from its prompt
        and whole output (so the first token, sampled at the end of prefill, needs no call of its own)."""
        ...

    def finish(self, req: "Request") -> None:
        """The request left (finished or aborted: `req.finish_reason` says which)."""
        ...

    def cached_bytes(self) -> int:
        """Memory the proposer keeps across requests (the suffix trees of finished answers), an estimate: it grows
        to a bound, and `peagle:proposer_cached_bytes` shows it beside the KV caches."""
        ...


class NoModelFreeDrafts:
    """The lifecycle of a proposer without model-free drafts (the heads alone): nothing to keep per request."""

    def prefill(self, req: "Request") -> None:
        pass

    def observe(self, req: "Request", draft: Draft, num_drafted: int, num_accepted: int,
                emitted: Sequence[int] = ()) -> None:
        pass

    def add_tokens(self, req: "Request", tokens: list[int]) -> None:
        pass

    def finish(self, req: "Request") -> None:
        pass

    def cached_bytes(self) -> int:
        return 0


class NoHead:
    """A proposer without a head (n-grams, suffix trees, none): `score` drafts every window it proposes."""
    head_name = None

    def draft(self, reqs: list["Request"], slots: "torch.Tensor", k: int, top: int = 0, grammars=()):
        raise RuntimeError(f"{type(self).__name__} has no head to draft with: its drafts come from score()")


class NullProposer(NoHead, NoModelFreeDrafts):
    """The proposer of an engine that does not speculate."""
    names: tuple[str, ...] = ()

    def score(self, reqs: Sequence["Request"]) -> list[Draft | None]:
        return [None] * len(reqs)  # the policy (NoSpeculation) gives every window k = 0
