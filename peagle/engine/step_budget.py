"""The time budget of one engine step (docs/engine.md, "Step time budget").

While streams decode, a step's admission work (the prompts' next chunks through the target, the drafter's catch-up
on their rows, the prefix-cache block writes and prompt log-probabilities that come with a chunk) is sized so that
the whole step costs at most `target_s`: by default DEFAULT_STEP_TIME_MULTIPLE plain decode steps of one request
on this machine, or what `max_step_time_ms` says. The oldest prompt always gets one block (BLOCK_SIZE tokens), so a
long prompt progresses however dear a step is; `max_num_batched_tokens` stays the upper bound in tokens. With no
stream decoding there is nobody to wait: the budget in time is off and chunks are as large as the token bound.

Costs come from a model of a forward over n rows whose first row sits at position ctx (it attends to ctx + n / 2
positions on average):

    seconds(n, ctx) = fixed + n * (per_row + per_row_ctx * (ctx + n / 2))      (+ per_logit_row for each row whose
                                                                                  logits a chunk needs)

calibrated at start-up from a few forwards on scratch rows (the target's and the drafter's, each its own model) and
corrected online: every timed chunk, drafter slice and decode step moves an exponential average of measured over
predicted (the machine's load and heat change what a step costs). The plain decode step the default target is a
multiple of follows the target's correction, and the decode part of the next step is predicted from the average of
the decode parts measured.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from peagle.engine.prefix_cache import BLOCK_SIZE

# The default target of a step in which streams decode, in plain decode steps of one request: enough prefill per
# step that a prompt admitted beside a stream reaches its first token within about 1.2x of its time alone (each
# step's decode and forward overhead is then a small share), and little enough that the stream's longest wait stays
# under a quarter of a second on a CPU core, overshoots included (at 12 the longest step reached 0.25-0.27 s on a
# Zen 3 core; docs/engine.md, "Step time budget", measures both).
DEFAULT_STEP_TIME_MULTIPLE = 10
CALIBRATION_ROWS = 2 * BLOCK_SIZE  # rows of the wider calibration forwards
CORRECTION_RATE = 0.2  # how fast a cost model's correction follows the measured/predicted ratio
DECODE_RATE = 0.3  # how fast the predicted decode part follows the measured ones
MAX_SURPRISE = 4.0  # one timing moves a correction by at most this factor's share (preemption, page faults)


@dataclass
class ForwardCost:
    """Seconds of one forward as a function of its rows and the context they attend to (module docstring)."""
    fixed: float = 0.0
    per_row: float = 0.0
    per_row_ctx: float = 0.0
    per_logit_row: float = 0.0
    correction: float = 1.0  # measured / predicted, exponentially averaged

    @classmethod
    def fit(cls, one: float, wide: float, wide_far: float, far: int, wide_logits: float | None = None
            ) -> "ForwardCost":
        """From the seconds of 1 and CALIBRATION_ROWS rows at position 0, the latter at position `far`, and
        optionally the latter with every row's logits. Noisy timings never make a term negative."""
        n = CALIBRATION_ROWS
        per_row = max(0.0, (wide - one) / (n - 1))
        fixed = max(0.0, one - per_row)
        per_row_ctx = max(0.0, (wide_far - wide) / (n * far)) if far else 0.0
        per_logit = max(0.0, (wide_logits - wide) / n) if wide_logits is not None else 0.0
        return cls(fixed, per_row, per_row_ctx, per_logit)

    def rows(self, n: int, ctx: int) -> float:
        """The part of n rows at positions ctx.. (no fixed cost, no logits), uncorrected."""
        return n * (self.per_row + self.per_row_ctx * (ctx + n / 2))

    def predict(self, entries: list[tuple[int, int]], logit_rows: int = 0) -> float:
        """Seconds of one forward over batch entries (rows, first position) and logits for logit_rows rows."""
        if not entries:
            return 0.0
        raw = self.fixed + sum(self.rows(n, ctx) for n, ctx in entries) + logit_rows * self.per_logit_row
        return raw * self.correction

    def observe(self, predicted: float, seconds: float) -> None:
        """A timed forward that was predicted to take `predicted` seconds."""
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(MAX_SURPRISE, max(1 / MAX_SURPRISE, seconds / predicted))
        self.correction *= 1 + CORRECTION_RATE * (ratio - 1)


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

    def __init__(self, clock: Callable[[], float], max_step_time_ms: float | None = None,
                 multiple: float = DEFAULT_STEP_TIME_MULTIPLE):
        if max_step_time_ms is not None and not max_step_time_ms > 0:
            raise ValueError(f"max_step_time_ms must be positive (or None for {multiple:g} plain decode steps), got "
                             f"{max_step_time_ms}")
        self.clock = clock
        self.fixed_target_s = max_step_time_ms / 1000 if max_step_time_ms is not None else None
        self.multiple = multiple
        self.target = ForwardCost(per_row=1.0)  # until calibrated: every row dear, so chunks start at one block
        self.drafter = ForwardCost(per_row=1.0)
        self.decode_step_s = 1.0 / multiple
        self.decode_part_s: float | None = None  # predicted decode part of a step (None until one was measured)
        self.left = math.inf
        self.last = StepRecord()
        self._started = self._prefill_done = 0.0

    def calibrate(self, time_target: Callable[[int, int, bool], float], time_decode_step: Callable[[], float],
                  time_drafter: Callable[[int, int], float] | None, max_position: int) -> None:
        """time_target(rows, position, every_row_logits) and time_drafter(rows, position): seconds of one forward
        over rows at positions position.. of a scratch slot; time_decode_step(): a plain decode step's forward."""
        far = max(0, min(2048, max_position - CALIBRATION_ROWS))
        n = CALIBRATION_ROWS
        self.target = ForwardCost.fit(time_target(1, 0, False), time_target(n, 0, False), time_target(n, far, False),
                                      far, time_target(n, 0, True))
        if time_drafter is not None:
            self.drafter = ForwardCost.fit(time_drafter(1, 0), time_drafter(n, 0), time_drafter(n, far), far)
        self.decode_step_s = time_decode_step()

    @property
    def target_s(self) -> float:
        """Seconds a step in which streams decode may cost."""
        if self.fixed_target_s is not None:
            return self.fixed_target_s
        return self.multiple * self.decode_step_s * self.target.correction

    # -- one step --------------------------------------------------------------------------------------------------
    def start_step(self, decoding: bool) -> None:
        """Open a step's budget: what the target leaves after the predicted decode part, or no limit in time when
        no stream decodes in it."""
        self._started = self.clock()
        self.last = StepRecord()
        if not decoding:
            self.left = math.inf
            return
        decode = self.decode_part_s if self.decode_part_s is not None else self.decode_step_s
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
