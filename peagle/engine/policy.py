"""How many drafts to verify each step (docs/engine.md, "Choosing K").

Every policy has the shape of `SpeculationPolicy`, and `NoSpeculation` is the one that never drafts (an engine
without a drafter runs it), so the engine never asks whether speculation is on before asking the policy.
`FixedK` verifies the configured `num_speculative_tokens` every step, as vLLM does. `AdaptiveK` treats that number
as a maximum and picks, before every step, how many drafts each request verifies, for the most expected output
tokens per second:

    expected tokens of request b with K_b drafts   E_b = 1 + s_b,1 + ... + s_b,K_b   (at most what b may still emit)
    survival of draft position i                   s_b,i = a_b,1 * ... * a_b,i
    a step                                         sum_b E_b / (target(B + sum_b K_b) + drafter(#{b: K_b > 0}, max K_b))

a_b,i is the acceptance of position i given that position i-1 was accepted, from exponentially forgotten counts of
request b, with the engine-wide estimate as its prior (so a new request starts from what the engine has seen, and a
request whose text changes character moves off it within a few steps). target(rows) and drafter(requests, K) are
forward times from the engine's cost model (forward_cost.py), measured at start-up and corrected from every real
step.

Every request's window is its own: the engine verifies all of a step's rows in one target forward, each request
only its own K_b + 1 (docs/engine.md, "Choosing K"), so a draft slot (b, i) costs one verify row wherever it is.
Slots are taken best first, as vLLM's adaptive verification does, while they raise the step's tokens per second;
a request may get none. A window must beat the plain step by SPECULATION_MARGIN. When the plain step has won many
steps in a row, one draft for the most promising request re-measures acceptance (a head that was useless on one
stretch of text may be good on the next); the wait doubles after every probe that does not bring drafting back,
except while one draft is expected to come close to a plain step's tokens per second: there probes are cheap and
come every few steps, since only drafting steps can correct an estimate that early rejections left just below the
break-even point.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

# The policies' names and the default of the engine and every command live with the speculative config.
from peagle.config import DEFAULT_SPECULATION_POLICY as DEFAULT_POLICY
from peagle.config import SPECULATION_POLICIES as POLICIES
from peagle.config import SPECULATION_POLICY_ENV
from peagle.engine.acceptance import AcceptanceEstimate, Candidate, MeasuredAcceptance
from peagle.engine.forward_cost import ForwardCost

PROBE_AFTER = 16  # plain steps in a row after which one step drafts a single token to re-measure acceptance ...
PROBE_AFTER_MAX = 256  # ... a wait that doubles after every probe that does not bring drafting back, up to this
# ... but where one draft is expected to come within PROBE_NEAR of a plain step's tokens per second, a probe costs
# little and its verdict matters: probe after PROBE_AFTER_NEAR plain steps, without doubling. Otherwise an estimate
# that a few early rejections put just below the break-even point would stay there, since only drafting steps
# correct it (on a head that pays 1.1x at K = 1, the policy then ran at plain speed in simulation).
PROBE_NEAR = 0.95
PROBE_AFTER_NEAR = 4
# A window must promise this much more than a plain step to be chosen: estimates and timings are noisy, and a wrong
# window costs more (drafter, verify rows) than a wrongly plain step loses.
SPECULATION_MARGIN = 1.05
class SpeculationPolicy(Protocol):
    """What the engine asks of a policy, in the order it asks: `choose` before a step (the only call that decides
    anything), then `observe` for each request that drafted; `forget` when a request leaves. `cost`: the engine's
    cost model if the policy chooses by it (None: it chooses without one), which then also shapes draft trees."""
    name: str
    max_k: int
    cost: ForwardCost | None

    def choose(self, requests: Sequence[Candidate]) -> list[int]: ...
    def value(self, request: Candidate, batch: int = 1) -> float: ...
    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None: ...
    def forget(self, request_id: str) -> None: ...


class NoSpeculation:
    """Never drafts: the policy of an engine without a drafter, and the base of the others (whatever a policy does
    not need to hear about is a no-op here)."""

    name = "none"
    max_k = 0
    cost = None

    def choose(self, requests: Sequence[Candidate]) -> list[int]:
        return [0] * len(requests)

    def value(self, request: Candidate, batch: int = 1) -> float:
        """How much speculating this request alone, in a step of `batch` requests, is expected to pay: the step's
        expected tokens per second over a plain step's (1.0: no better than plain). The hybrid's measure for
        choosing between drafts. Without a cost model a model-free draft, where there is one, is preferred: it
        costs no drafter forward."""
        if request.draft is not None:
            return math.inf if request.draft.tokens else 0.0
        return 1.0

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class FixedK(NoSpeculation):
    """Always the configured K (vLLM's behaviour): the head's K, a model-free draft's whole length (up to max_k)."""

    name = "fixed"

    def __init__(self, k: int, head_k: int | None = None):
        self.max_k, self.head_k = k, k if head_k is None else head_k

    def choose(self, requests: Sequence[Candidate]) -> list[int]:
        return [self.head_k if r.draft is None else min(self.max_k, len(r.draft.tokens)) for r in requests]


class AdaptiveK(NoSpeculation):
    """The window that maximises expected tokens per second, from acceptance estimates and a step-cost model."""

    name = "adaptive"

    def __init__(self, cost: ForwardCost):
        """Windows of up to cost.max_k drafts; the head's up to cost.max_head_k (0: no head, model-free drafts
        only)."""
        self.max_k, self.head_k, self.cost = cost.max_k, cost.max_head_k, cost
        self.acceptance = MeasuredAcceptance(self.head_k)  # the head's
        self.plain_steps_in_a_row = 0
        self.probe_after = PROBE_AFTER

    def estimate(self, request_id: str) -> AcceptanceEstimate:
        """The head's acceptance estimate for this request."""
        return self.acceptance.estimate(request_id)

    def margins(self, request: Candidate) -> list[float]:
        """s_1, s_2, ..: what each further draft of this request adds to its expected tokens (nothing past the
        request's last token): the head's from its acceptance estimate, a model-free draft's from its proposer."""
        if request.draft is not None:
            return request.draft.survival[: max(0, min(self.max_k, request.remaining - 1))]
        useful = max(0, min(self.head_k, request.remaining - 1))
        return self.estimate(request.request_id).survival()[:useful]

    def value(self, request: Candidate, batch: int = 1) -> float:
        """The best window's expected tokens per second for a step of `batch` requests where this one alone drafts,
        over a plain step's. In a batch the reading of the weights is already shared, so a verify row is a larger
        part of a request's share of the step than alone: a draft that pays alone may not pay there."""
        margins, best, tokens = self.margins(request), 1.0, float(batch)
        plain = self.cost.predict_target(batch)
        for w, s in enumerate(margins, start=1):
            tokens += s
            drafter = self.cost.predict_draft(1, w) if request.draft is None else 0.0
            best = max(best, tokens * plain / (batch * (self.cost.predict_target(batch + w) + drafter)))
        return best

    def choose(self, requests: Sequence[Candidate]) -> list[int]:
        """K per request. Draft slots (request b, position i) are worth s_b,i expected tokens; for each widest
        head window W they are taken best first (so each request's slots stay a prefix) while the step's expected
        tokens per second rise; the best (W, slots) wins if it beats the plain step by SPECULATION_MARGIN. A
        model-free draft's slots cost verify rows only, whatever W (no drafter runs for them)."""
        batch = len(requests)
        margins = [self.margins(r) for r in requests]
        heads = [r.draft is None for r in requests]
        target = [self.cost.predict_target(batch + n) for n in range(sum(map(len, margins)) + 1)]
        plain = batch / target[0]
        best_rate, best = plain, [0] * batch
        head_windows = range(1, self.head_k + 1) if any(h and m for h, m in zip(heads, margins)) else [0]
        for w in head_windows:
            slots = sorted((-s, b, i) for b, m in enumerate(margins) for i, s in enumerate(m[:w] if heads[b] else m))
            draft = [0.0] + [self.cost.predict_draft(m, w) if w else 0.0 for m in range(1, batch + 1)]
            ks, tokens, drafted, left = [0] * batch, float(batch), 0, -sum(neg_s for neg_s, _, _ in slots)
            for n, (neg_s, b, i) in enumerate(slots, start=1):
                ks[b] = i + 1
                drafted += i == 0 and heads[b]
                tokens, left = tokens - neg_s, left + neg_s
                cost = target[n] + draft[drafted]
                if tokens / cost > best_rate:
                    best_rate, best = tokens / cost, list(ks)
                elif (tokens + left) / cost <= best_rate:
                    break  # costs only grow: even every slot left could not win
        if any(best) and best_rate >= SPECULATION_MARGIN * plain:
            self.plain_steps_in_a_row, self.probe_after = 0, PROBE_AFTER
            self._age(requests, best)
            return best
        ks = [0] * batch
        self.plain_steps_in_a_row += 1
        promising = max(range(batch), key=lambda b: margins[b][0] if margins[b] else -1.0)
        if margins[promising]:
            # One draft for the most promising request re-measures acceptance: one more verify row (and the
            # drafter for one request where the head drafts it), not a window for the whole batch. Model-free
            # drafts need this as much as the head: their measured acceptance caps their drafts, and only
            # verified drafts correct it, so a few early rejections would otherwise switch them off for good.
            drafter = self.cost.predict_draft(1, 1) if heads[promising] else 0.0
            probe_rate = (batch + margins[promising][0]) / (target[1] + drafter)
            near = probe_rate >= PROBE_NEAR * plain
            if self.plain_steps_in_a_row > (PROBE_AFTER_NEAR if near else self.probe_after):
                self.plain_steps_in_a_row = 0
                if not near:
                    self.probe_after = min(2 * self.probe_after, PROBE_AFTER_MAX)
                ks[promising] = 1
        self._age(requests, ks)
        return ks

    def _age(self, requests: Sequence[Candidate], ks: list[int]) -> None:
        """Requests whose head does not draft this step (a plain step, or a model-free draft's) learn nothing about
        it; its estimates age instead."""
        if not self.head_k:
            return
        for r, k in zip(requests, ks):
            if k == 0 or r.draft is not None:
                self.acceptance.observe(r.request_id, 0, 0)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(request_id, num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)


class OffAtBatchSize:
    """vLLM's `disable_by_batch_size`: no drafts while at least `batch_size` requests run, decided before the
    policy it wraps is asked, so that policy learns nothing from steps it did not choose."""

    def __init__(self, policy: SpeculationPolicy, batch_size: int):
        self.policy, self.batch_size = policy, batch_size
        self.name, self.max_k, self.cost = policy.name, policy.max_k, policy.cost

    def choose(self, requests: Sequence[Candidate]) -> list[int]:
        return [0] * len(requests) if len(requests) >= self.batch_size else self.policy.choose(requests)

    def value(self, request: Candidate, batch: int = 1) -> float:
        return self.policy.value(request, batch)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.policy.observe(request_id, num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)


def make_policy(name: str, cost: ForwardCost, disable_by_batch_size: int | None = None) -> SpeculationPolicy:
    """The policy called `name` for the windows `cost` describes (drafts up to cost.max_k, the head's up to
    cost.max_head_k), off while disable_by_batch_size requests run."""
    policy: SpeculationPolicy
    if name == "fixed":
        policy = FixedK(cost.max_k, cost.max_head_k)
    elif name == "adaptive":
        policy = AdaptiveK(cost)
    else:
        raise ValueError(f"unknown speculation policy {name!r}: choose one of {', '.join(POLICIES)} "
                     f"(--speculation-policy or {SPECULATION_POLICY_ENV})")
    return OffAtBatchSize(policy, disable_by_batch_size) if disable_by_batch_size else policy
