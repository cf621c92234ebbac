"""What a forward costs on this machine (docs/engine.md, "Cost model"): one model, measured at start-up on scratch
rows (calibration.py) and corrected from every timed forward, that the speculation policy (how many drafts a step
verifies, how large a draft tree grows) and the step budget (how much prefill a step holds) both read.

    a decode step      target(R) + drafter(B_d, K)      R rows verified, B_d requests drafting K tokens each
    a prompt chunk     fixed + sum over entries of n * (per_row + per_row_ctx * (ctx + n / 2)) + logit rows
    a drafter catch-up the same form, the drafter's terms

target(R) and drafter(B, K) are tables timed at a grid of shapes and interpolated between them, each cell with its
own correction learnt from real steps, and every decode prediction scaled by one drift factor (the machine getting
slower or faster: other processes, heat). A chunk has no table (its rows and context vary too much): its linear
terms are fitted to four timed forwards and scaled by a correction of their own. The plain decode step the step
budget is a multiple of is target(1) as corrected.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from peagle.engine.prefix_cache import BLOCK_SIZE

CALIBRATION_ROWS = 2 * BLOCK_SIZE  # rows of the wider chunk calibration forwards
COST_CELL_RATE = 0.2  # how fast one decode shape's cell follows its own timings
COST_DRIFT_RATE = 0.05  # how fast every decode shape follows the machine's drift (load from other processes, heat)
DRAFT_DRIFT_RATE = 0.1  # how fast every drafting shape follows what drafting steps turn out to cost
CORRECTION_RATE = 0.2  # how fast a chunk model's correction follows the measured/predicted ratio
MAX_SURPRISE = 4.0  # one chunk timing moves its correction by at most this factor's share (preemption, page faults)
# Past these shapes a forward is compute-bound (the weights' read is shared by enough rows), so its cost grows
# linearly: wider shapes are extrapolated from the two widest timed, and start-up never times a 1,024-row forward.
MAX_TIMED_ROWS = 64
MAX_TIMED_BATCH = 16


@dataclass
class ChunkCost:
    """Seconds of one forward over batch entries of n rows whose first row sits at position ctx (module docstring):
    a prompt chunk through the target, or the drafter's catch-up rows."""
    fixed: float = 0.0
    per_row: float = 0.0
    per_row_ctx: float = 0.0
    per_logit_row: float = 0.0
    correction: float = 1.0  # measured / predicted, exponentially averaged

    @classmethod
    def fit(cls, one: float, wide: float, wide_far: float, far: int, wide_logits: float | None = None
            ) -> "ChunkCost":
        """From the seconds of 1 and CALIBRATION_ROWS rows at position 0, the latter at position `far`, and
        optionally the latter with every row's logits. Noisy timings never make a term negative."""
        n = CALIBRATION_ROWS
        per_row = max(0.0, (wide - one) / (n - 1))
        fixed = max(0.0, one - per_row)
        per_row_ctx = max(0.0, (wide_far - wide) / (n * far)) if far else 0.0
        per_logit = max(0.0, (wide_logits - wide) / n) if wide_logits is not None else 0.0
        return cls(fixed, per_row, per_row_ctx, per_logit)

    def predict(self, entries: list[tuple[int, int]], logit_rows: int = 0) -> float:
        """Seconds of one forward over batch entries (rows, first position) and logits for logit_rows rows."""
        if not entries:
            return 0.0
        rows = sum(n * (self.per_row + self.per_row_ctx * (ctx + n / 2)) for n, ctx in entries)
        return (self.fixed + rows + logit_rows * self.per_logit_row) * self.correction

    def observe(self, predicted: float, seconds: float) -> None:
        """A timed forward that was predicted to take `predicted` seconds."""
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(MAX_SURPRISE, max(1 / MAX_SURPRISE, seconds / predicted))
        self.correction *= 1 + CORRECTION_RATE * (ratio - 1)


class ForwardCost:
    """The engine's one cost model (module docstring): decode steps for the policy and the tree shaper, prompt
    chunks (`prefill`) and drafter catch-up (`catch_up`) for the step budget."""

    def __init__(self, max_batch: int, max_k: int, max_head_k: int | None = None, tree_rows: int = 0):
        """Decode windows up to max_k verified drafts per request; the head drafts at most max_head_k of them
        (default: max_k; fewer where model-free drafts, which cost no drafter forward, run longer; 0: no head); a
        draft tree may add up to tree_rows rows to a step."""
        max_head_k = max_k if max_head_k is None else max_head_k
        self.max_batch, self.max_k, self.max_head_k = max_batch, max_k, max_head_k
        self.tree_rows = tree_rows
        self.max_rows = self.rows_for(max_batch, max_k, tree_rows)
        self.target = [float(n) for n in range(self.max_rows + 1)]  # until calibrated
        self.draft = [[0.5 * m * k for k in range(max_head_k + 1)] for m in range(max_batch + 1)]
        self.target_cell = [1.0] * (self.max_rows + 1)
        self.draft_cell = [[1.0] * (max_head_k + 1) for _ in range(max_batch + 1)]
        self.drift = 1.0
        self.draft_drift = 1.0
        self.prefill = ChunkCost(per_row=1.0)  # until calibrated: every row dear, so chunks start at one block
        self.catch_up = ChunkCost(per_row=1.0)

    @staticmethod
    def rows_for(max_batch: int, max_k: int, tree_rows: int = 0) -> int:
        """The most rows a step verifies: every request's widest window, and a draft tree's rows past its window."""
        return max_batch * (max_k + 1) + tree_rows

    def grid(self) -> tuple[list[int], list[int], list[int]]:
        """The decode shapes calibration times (row counts of the target; requests and windows of the drafter);
        the rest is interpolated between them, or extrapolated past the widest."""
        rows = sorted(set(_powers_of_two_below(min(self.max_rows, MAX_TIMED_ROWS))) |
                      {min(self.max_rows, MAX_TIMED_ROWS)})
        bs = sorted(set(_powers_of_two_below(min(self.max_batch, MAX_TIMED_BATCH))) |
                    {1, min(self.max_batch, MAX_TIMED_BATCH)})
        # The drafter's cost grows about linearly in K (a chain: one forward per draft; parallel: wider rows).
        k = self.max_head_k
        ks = sorted({1, (1 + k) // 2, k}) if k else []
        return rows, bs, ks

    def calibrate(self, time_target: Callable[[int], float], time_draft: Callable[[int, int], float],
                  time_chunk: Callable[[int, int, bool], float],
                  time_catch_up: Callable[[int, int], float] | None, max_position: int) -> None:
        """Fill the model from start-up timings: time_target(rows) of a decode-shaped verify forward,
        time_draft(requests, k) of the head's drafting, time_chunk(rows, position, every_row_logits) of a prompt
        chunk, time_catch_up(rows, position) of the drafter's real rows (None: no head)."""
        self.calibrate_decode(time_target, time_draft)
        far, n = max(0, min(2048, max_position - CALIBRATION_ROWS)), CALIBRATION_ROWS
        self.prefill = ChunkCost.fit(time_chunk(1, 0, False), time_chunk(n, 0, False), time_chunk(n, far, False),
                                     far, time_chunk(n, 0, True))
        if time_catch_up is not None:
            self.catch_up = ChunkCost.fit(time_catch_up(1, 0), time_catch_up(n, 0), time_catch_up(n, far), far)

    def calibrate_decode(self, time_target: Callable[[int], float], time_draft: Callable[[int, int], float]) -> None:
        """The decode tables from time_target(rows) and time_draft(requests, k) at the grid's shapes. For each
        number of requests the drafter's windows get the least-squares line through the timed ones (one noisy
        timing must not make a window look cheap: a cell the policy then never chooses is never corrected); shapes
        in between are interpolated."""
        rows, bs, ks = self.grid()
        timed_rows = {n: time_target(n) for n in rows}
        for n in range(1, self.max_rows + 1):
            n0, n1 = _bracket(rows, n)
            self.target[n] = _lerp(n, n0, n1, timed_rows[n0], timed_rows[n1])
        if ks:
            lines = {b: [0.0] + _line([(k, time_draft(b, k)) for k in ks], self.max_head_k) for b in bs}
            for b in range(1, self.max_batch + 1):
                b0, b1 = _bracket(bs, b)
                self.draft[b] = [_lerp(b, b0, b1, lines[b0][k], lines[b1][k]) for k in range(self.max_head_k + 1)]

    # -- decode steps ------------------------------------------------------------------------------------------
    def predict_target(self, rows: int) -> float:
        return self.target[rows] * self.target_cell[rows] * self.drift

    def predict_draft(self, drafted: int, k: int) -> float:
        return self.draft[drafted][k] * self.draft_cell[drafted][k] * self.draft_drift * self.drift

    def predict(self, rows: int, drafted: int = 0, k: int = 0) -> float:
        return self.predict_target(rows) + (self.predict_draft(drafted, k) if drafted else 0.0)

    @property
    def decode_step(self) -> float:
        """Seconds of a plain decode step of one request, as corrected."""
        return self.predict_target(1)

    def observe(self, rows: int, drafted: int, k: int, seconds: float) -> None:
        """A real decode step's time. A plain step corrects its row count's cell; a drafting step charges what it
        took beyond the target's predicted share to the drafter: to a factor shared by every drafting shape
        (requests and K vary from step to step, so one cell alone would learn too slowly to stop a run of dear
        windows) and to its own cell."""
        predicted = self.predict(rows, drafted, k)
        self.drift += COST_DRIFT_RATE * (seconds / predicted - 1.0) * self.drift
        if not drafted:
            measured = seconds / (self.target[rows] * self.drift)
            self.target_cell[rows] += COST_CELL_RATE * (measured - self.target_cell[rows])
            return
        base = self.draft[drafted][k] * self.drift
        if base > 0:
            measured = max(0.0, seconds - self.predict_target(rows)) / base  # = cell x shared factor, ideally
            cell = self.draft_cell[drafted][k]
            self.draft_drift += DRAFT_DRIFT_RATE * (measured / cell - self.draft_drift)
            self.draft_cell[drafted][k] += COST_CELL_RATE * (measured / self.draft_drift - cell)


def _line(points: list[tuple[int, float]], max_k: int) -> list[float]:
    """Values at 1..max_k of the least-squares line through points (never falling with W)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    return [my + slope * (w - mx) for w in range(1, max_k + 1)]


def _powers_of_two_below(n: int) -> list[int]:
    return [1 << i for i in range(max(0, n - 1).bit_length())]


def _bracket(grid: list[int], x: int) -> tuple[int, int]:
    """The grid points around x; past the widest, the two widest (to extrapolate from)."""
    if x > grid[-1]:
        return (grid[-2], grid[-1]) if len(grid) > 1 else (grid[-1], grid[-1])
    lo = max(g for g in grid if g <= x)
    hi = min(g for g in grid if g >= x)
    return lo, hi


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    """Linear between (x0, y0) and (x1, y1); past x1 the line goes on, never falling below y1."""
    if x1 == x0:
        return y0
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, y1) if x > x1 else y
