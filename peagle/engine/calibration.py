"""Start-up timings on scratch rows, which the speculation policy (policy.StepCostModel) and the step budget
(step_budget.StepBudget) calibrate their cost models from. Every forward writes cache slots that no request holds
yet: their entries are stale the moment a request takes the slot."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from peagle.engine.timing import timed
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel

if TYPE_CHECKING:
    from peagle.engine.proposers.heads import HeadProposer


class ScratchTimings:
    def __init__(self, target: TargetModel, target_cache, head: HeadProposer | None, max_num_seqs: int,
                 max_model_len: int, clock: Callable[[], float]):
        self.target, self.target_cache, self.head, self.clock = target, target_cache, head, clock
        self.max_num_seqs, self.device = max_num_seqs, target.device
        self.context = min(128, max_model_len // 2)  # cached positions a decode row attends to: a typical context

    # -- the policy's: a decode step's verify forward and the head's drafting ----------------------------------
    def target_rows(self, rows: int) -> float:
        """Seconds of the target's forward over `rows` rows, one per batch entry, spread over the cache slots."""
        dev = self.device
        slot_of_row = torch.arange(rows, device=dev) % self.max_num_seqs
        positions = self.context + torch.arange(rows, device=dev) // self.max_num_seqs
        layout = BatchLayout.build(slot_of_row, positions[:, None])
        tokens = torch.ones(rows, 1, dtype=torch.long, device=dev)

        def forward():
            with torch.inference_mode():
                self.target(tokens, layout, self.target_cache, num_logits=None)

        return timed(forward, self.clock)

    def head_draft(self, batch: int, k: int) -> float:
        """Seconds of the head drafting k tokens for `batch` requests (no head: nothing to time)."""
        return self.head.time_draft(batch, k, self.context, self.clock) if self.head else 0.0

    # -- the step budget's: a prompt chunk's forwards, the target's and the drafter's, in slot 0 ----------------
    def prefill_chunk(self, rows: int, position: int, every_row_logits: bool) -> float:
        """Seconds of the target's forward over one chunk of `rows` prompt rows from `position` (without logits, as
        a chunk that does not end its prompt; or with every row's log-probabilities, as for prompt_logprobs)."""
        tokens, layout = self._chunk(rows, position)

        def forward():
            with torch.inference_mode():
                if every_row_logits:
                    torch.log_softmax(self.target(tokens, layout, self.target_cache, num_logits=None).logits, -1)
                else:
                    self.target.trunk(tokens, layout, self.target_cache)

        return timed(forward, self.clock, repeats=1)

    def drafter_rows(self, rows: int, position: int) -> float:
        """Seconds of the drafter's catch-up pass over `rows` real rows from `position`."""
        tokens, layout = self._chunk(rows, position)
        drafter = self.head.drafter
        w = drafter.fc.weight
        feats = torch.zeros(1, rows, w.shape[1], dtype=w.dtype, device=self.device)

        def forward():
            with torch.inference_mode():
                drafter(tokens, feats, layout, self.head.cache)

        return timed(forward, self.clock, repeats=1)

    def _chunk(self, rows: int, position: int) -> tuple[torch.Tensor, BatchLayout]:
        dev = self.device
        positions = position + torch.arange(rows, device=dev)[None, :]
        return (torch.ones(1, rows, dtype=torch.long, device=dev),
                BatchLayout.build(torch.zeros(1, dtype=torch.long, device=dev), positions))
