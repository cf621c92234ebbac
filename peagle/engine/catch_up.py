"""The drafter's catch-up on real rows (docs/design.md, "Decoding step"). Every verified position is a real row the
head's drafter must run before it can draft from it; rows wait in the request (request.DrafterBacklog) until its
head drafts, so a request that some other proposer drafts for, or none, never pays for the drafter. Before a step
drafts, the drafter runs waiting rows in slices under the step's time budget (step_budget.py), oldest request first:
of a request whose head drafts this step all but the newest (the draft's forward brings those along), and of a
request past max_pending_rows the oldest, so that a request's waiting rows stay bounded in memory.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from peagle.engine.step_budget import StepBudget
from peagle.model.layers import BatchLayout

if TYPE_CHECKING:
    from peagle.engine.request import Request
    from peagle.engine.step_plan import StepPlan
    from peagle.model.drafter import Drafter

# Features of real rows (prompt included) a request may hold back from the drafter while its head does not draft:
# past this the oldest run anyway (a bound on memory, not on time: catching up later costs the same rows).
MAX_PENDING_BYTES = 16 << 20
# Waiting rows a request may bring into a joint (padded) drafting pass; more run first, on their own.
JOINT_PENDING_ROWS = 16


class DrafterCatchUp:
    def __init__(self, drafter: Drafter | None, drafter_cache, budget: StepBudget, max_num_batched_tokens: int,
                 row_bytes: int, device):
        """`row_bytes`: the bytes of one row's target features (MAX_PENDING_BYTES is counted in them)."""
        self.drafter, self.cache, self.budget, self.device = drafter, drafter_cache, budget, device
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_pending_rows = max(JOINT_PENDING_ROWS + 1, MAX_PENDING_BYTES // row_bytes)

    def drafts_later(self, req: Request) -> bool:
        """Whether the drafter may ever draft for this request (so its real rows must wait for it)."""
        return self.drafter is not None and req.decodes

    def rows_due(self, req: Request, coming: int = 0) -> int:
        """Waiting rows the drafter must run now to keep the request's backlog within max_pending_rows once
        `coming` more rows join it."""
        if not self.drafts_later(req):
            return 0
        return max(0, len(req.backlog) + coming - self.max_pending_rows)

    def before_drafting(self, running: list[Request], plan: StepPlan) -> tuple[int, set[Request]]:
        """Run waiting rows for this step's head windows and for requests past the bound (`catch_up`). Returns the
        rows run and the requests whose head is still more than JOINT_PENDING_ROWS behind after its slice: they
        verify no window this step (they draft from a later one)."""
        rows = self.catch_up(running, {w.request for w in plan.head_windows})
        return rows, {w.request for w in plan.head_windows if len(w.request.backlog) > JOINT_PENDING_ROWS}

    def catch_up(self, running: list[Request], heads: set[Request]) -> int:
        """The drafter runs waiting real rows, oldest request first, as far as the step's budget goes (and at most
        max_num_batched_tokens a request): of a request in `heads` (its head drafts this step) all but the newest,
        the first such request at least one block; of a request past max_pending_rows all but the newest
        JOINT_PENDING_ROWS, and at least the rows past the bound (and one block) whatever the budget: a bound on
        memory, reached again only a block or more later. Returns the rows run."""
        budget, total = self.budget, 0
        clock = budget.clock
        for req in running:
            if req.finished or not self.drafts_later(req):
                continue
            due, waiting, start = self.rows_due(req), len(req.backlog), req.backlog.start
            if req in heads and waiting > JOINT_PENDING_ROWS:
                cap = waiting - 1
            elif due:
                cap = waiting - JOINT_PENDING_ROWS
            else:
                continue
            cap = min(cap, self.max_num_batched_tokens)  # a step's bound in tokens, the drafter's as the target's
            rows = max(due, budget.largest(lambda n: budget.cost.catch_up.predict([(n, start)]), cap,
                                           floor=bool(due) or not total))
            predicted, started = budget.cost.catch_up.predict([(rows, start)]), clock()
            self.run(req, rows)
            seconds = clock() - started
            budget.cost.catch_up.observe(predicted, seconds)
            budget.spend(seconds)
            total += rows
        return total

    def run(self, req: Request, rows: int) -> None:
        """Bring one request's drafter cache up to date without drafting (real rows only: no mask slots, no LM
        head), alone, so no pad rows: its first `rows` waiting rows. In slices of at most max_num_batched_tokens
        rows, in order: the drafter computes each row as one pass would (docs/design.md), so slices change
        nothing."""
        backlog, dev = req.backlog, self.device
        feats = backlog.features()
        for lo in range(0, rows, self.max_num_batched_tokens):
            hi = min(rows, lo + self.max_num_batched_tokens)
            tokens = torch.tensor([backlog.tokens[lo:hi]], device=dev)
            positions = backlog.start + torch.arange(lo, hi, device=dev)[None, :]
            layout = BatchLayout.build(torch.tensor([req.slot], device=dev), positions)
            self.drafter(tokens, feats[None, lo:hi], layout, self.cache)
        backlog.consume(rows)
