"""The time budget of one engine step (docs/engine.md, "Step time budget").

While streams decode, a step's admission work (the prompts' next chunks through the target, the drafter's catch-up
on their rows, the prefix-cache block writes and prompt log-probabilities that come with a chunk) is sized so that
the whole step costs at most `target_s`: by default DEFAULT_STEP_TIME_MULTIPLE plain decode steps of one request
on this machine, or what `max_step_time_ms` says. The oldest prompt always gets one block (BLOCK_SIZE tokens), so a
long prompt progresses however dear a step is; `max_num_batched_tokens` stays the upper bound in tokens. With no
stream decoding there is nobody to wait: the budget in time is off and chunks are as large as the token bound.

Costs come from the engine's cost model (forward_cost.py): a chunk's from its prompt-chunk and catch-up terms,
the plain decode step the default target is a multiple of from its decode table, each as corrected by what was
measured since (the machine's load and heat change what a step costs). The decode part of the next step is
predicted from the average of the decode parts measured.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from peagle.engine.forward_cost import ForwardCost
from peagle.engine.prefix_cache import BLOCK_SIZE

# The default target of a step in which streams decode, in plain decode steps of one request: enough prefill per
# step that a prompt admitted beside a stream reaches its first token within about 1.2x of its time alone (each
# step's decode and forward overhead is then a small share), and little enough that the stream's longest wait stays
# under a quarter of a second on a CPU core, overshoots included (at 12 the longest step reached 0.25-0.27 s on a
# Zen 3 core; docs/engine.md, "Step time budget", measures both).
DEFAULT_STEP_TIME_MULTIPLE = 10
DECODE_RATE = 0.3  # how fast the predicted decode part follows the measured ones


@dataclass
class StepRecord:
    """What one step did, for /metrics: prompt tokens through the target, prompt rows through the drafter, and the
    step's seconds (of the engine's step clock)."""
    prefill_tokens: int = 0
    drafter_rows: int = 0
    seconds: float = 0.0


class StepBudget:
    """Plans each step's prefill work in time (module docstring). One per engine; `start_step` opens a step's
    budget, `fits`/`largest` size its work, `spend` and the `observe_*` calls report what was done and measured."""

    def __init__(self, clock: Callable[[], float], cost: ForwardCost, max_step_time_ms: float | None = None,
                 multiple: float = DEFAULT_STEP_TIME_MULTIPLE):
        if max_step_time_ms is not None and not max_step_time_ms > 0:
            raise ValueError(f"max_step_time_ms must be positive (or None for {multiple:g} plain decode steps), got "
                             f"{max_step_time_ms}")
        self.clock = clock
        self.fixed_target_s = max_step_time_ms / 1000 if max_step_time_ms is not None else None
        self.multiple = multiple
        self.cost = cost
        self.decode_part_s: float | None = None  # predicted decode part of a step (None until one was measured)
        self.left = math.inf
        self.last = StepRecord()
        self._started = self._prefill_done = 0.0

    @property
    def target_s(self) -> float:
        """Seconds a step in which streams decode may cost."""
        if self.fixed_target_s is not None:
            return self.fixed_target_s
        return self.multiple * self.cost.decode_step

    # -- one step --------------------------------------------------------------------------------------------------
    def start_step(self, decoding: bool) -> None:
        """Open a step's budget: what the target leaves after the predicted decode part, or no limit in time when
        no stream decodes in it."""
        self._started = self.clock()
        self.last = StepRecord()
        if not decoding:
            self.left = math.inf
            return
        decode = self.decode_part_s if self.decode_part_s is not None else self.cost.decode_step
        self.left = self.target_s - decode

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left

    def spend(self, seconds: float) -> None:
        self.left -= seconds

    def largest(self, cost: Callable[[int], float], cap: int, floor: bool) -> int:
        """The most rows, whole blocks up to `cap` (or `cap` itself), whose cost(rows) fits what is left; with
        `floor`, at least one block (or cap when smaller). 0 when nothing fits."""
        best = min(cap, BLOCK_SIZE) if floor else 0
        if math.isinf(self.left):
            return cap
        n = BLOCK_SIZE
        while n < cap and self.fits(cost(n)):
            best, n = n, n + BLOCK_SIZE
        if n >= cap and self.fits(cost(cap)):
            best = cap
        return best

    def end_prefill(self, prefill_tokens: int, drafter_rows: int) -> None:
        self._prefill_done = self.clock()
        self.last.prefill_tokens, self.last.drafter_rows = prefill_tokens, drafter_rows

    def end_step(self, decoded: bool) -> None:
        """Close the step: its time, and the decode part's (after the prefill) as the next step's prediction."""
        now = self.clock()
        self.last.seconds = now - self._started
        if decoded:
            part = now - self._prefill_done
            self.decode_part_s = part if self.decode_part_s is None else \
                self.decode_part_s + DECODE_RATE * (part - self.decode_part_s)
