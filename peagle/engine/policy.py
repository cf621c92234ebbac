"""How many drafts to verify each step (docs/engine.md, "Choosing K").

`FixedK` verifies the configured `num_speculative_tokens` every step, as vLLM does. `AdaptiveK` treats that number
as a maximum and picks, before every step, how many drafts each request verifies, for the most expected output
tokens per second:

    expected tokens of request b at window W   E_b(W) = 1 + s_b,1 + ... + s_b,W   (at most what b may still emit)
    survival of draft position i               s_b,i  = a_b,1 * ... * a_b,i
    a step with window W for requests S        sum_b E_b(K_b) / (cost(|S|, W) + cost(B - |S|, 0))

a_b,i is the acceptance of position i given that position i-1 was accepted, from exponentially forgotten counts of
request b, with the engine-wide estimate as its prior (so a new request starts from what the engine has seen, and a
request whose text changes character moves off it within a few steps). cost(B, W) is a table of forward times for
B requests at window W, measured at start-up (`StepCostModel.calibrate`) and corrected from every real step.

The choice is between one plain step for everyone (W = 0), one window W for everyone, and a window W for the m
requests that gain most from it while the rest take a plain step in a second forward. The target verifies a
rectangular [B, W + 1] batch, so inside one forward a request given fewer drafts than its neighbours would still
pay for its padded rows; a second forward reads the weights a second time, which pays only where verify rows are
dear (a compute-bound CPU at high concurrency). A window must beat the plain step by SPECULATION_MARGIN. When the
plain step has won many steps in a row, one step at W = 1 re-measures acceptance (a head that was useless on one
stretch of text may be good on the next); the wait doubles after every probe that does not bring drafting back.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

POLICIES = ("adaptive", "fixed")
DEFAULT_POLICY = "adaptive"  # of `peagle serve` and `peagle generate`; the engine itself defaults to vLLM's fixed K
ENV_VAR = "SM_VLLM_SPECULATION_POLICY"  # read by `peagle serve` (every flag maps to SM_VLLM_<NAME>) and generate

REQUEST_MEMORY = 0.7  # per-request counts keep this much weight per new observation (about 3 steps' memory)
PLAIN_STEP_MEMORY = 0.9  # ... and per step a position is not tried: back to the engine-wide estimate in ~10
ENGINE_MEMORY = 0.98  # engine-wide counts: about 50 observations
REQUEST_PRIOR_WEIGHT = 2.0  # the engine-wide estimate counts as this many observations in a request's estimate
INITIAL_ACCEPTANCE = 0.5  # before anything is seen: optimistic enough that the first steps draft and learn
INITIAL_WEIGHT = 0.5  # but weak: a few observations outweigh it
PROBE_AFTER = 16  # plain steps in a row after which one step drafts a single token to re-measure acceptance ...
PROBE_AFTER_MAX = 256  # ... a wait that doubles after every probe that does not bring drafting back, up to this
# A window must promise this much more than a plain step to be chosen: estimates and timings are noisy, and a wrong
# window costs more (drafter, verify rows) than a wrongly plain step loses.
SPECULATION_MARGIN = 1.05
COST_CELL_RATE = 0.2  # how fast one (B, W) cell follows its own timings
COST_DRIFT_RATE = 0.05  # how fast every cell follows the machine's drift (load from other processes, heat)


class AcceptanceEstimate:
    """Conditional acceptance per draft position, from exponentially forgotten counts.

    Position i is *tried* in a step when the window reached it and positions 1..i-1 were accepted; a_i is accepted
    over tried. A prior enters as pseudo-counts that are forgotten like real ones, so a request starts from the
    engine-wide estimate and within a few steps stands on its own data. The engine-wide estimate's prior for a
    position never tried is the estimate of the position before it."""

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
                self.prior_weight[i] *= self.memory
            else:
                self._age(i)

    def age(self) -> None:
        """A plain step: nothing is tried."""
        for i in range(len(self.tried)):
            self._age(i)

    def _age(self, i: int) -> None:
        """Position i was not tried: its evidence fades and the prior's weight returns, so a request whose estimate
        fell during a bad stretch drifts back to the engine-wide estimate instead of staying frozen at its worst
        (a position that is never tried cannot correct itself)."""
        if self.prior is None:  # the engine-wide estimate only learns
            return
        m = PLAIN_STEP_MEMORY
        self.tried[i] *= m
        self.accepted[i] *= m
        self.prior_weight[i] = m * self.prior_weight[i] + (1 - m) * REQUEST_PRIOR_WEIGHT

    def conditional(self) -> list[float]:
        prior = self.prior.conditional() if self.prior is not None else None
        out: list[float] = []
        for i, (a, t, w) in enumerate(zip(self.accepted, self.tried, self.prior_weight)):
            p = prior[i] if prior is not None else out[i - 1] if i else INITIAL_ACCEPTANCE
            out.append((a + w * p) / (t + w))
        return out

    def survival(self) -> list[float]:
        """s_i: the probability that the first i drafts are all accepted."""
        out, s = [], 1.0
        for a in self.conditional():
            s *= a
            out.append(s)
        return out


class StepCostModel:
    """Seconds per decode step for B requests at window W (0..max_k): a calibrated table times two corrections
    learnt from real steps, one per cell (the calibration's error at that shape) and one shared by all cells (the
    machine getting slower or faster)."""

    def __init__(self, max_batch: int, max_k: int):
        self.max_batch, self.max_k = max_batch, max_k
        self.base = [[1.0 + b * (w + 1) for w in range(max_k + 1)] for b in range(max_batch + 1)]  # until calibrated
        self.cell = [[1.0] * (max_k + 1) for _ in range(max_batch + 1)]
        self.drift = 1.0

    @staticmethod
    def grid(max_batch: int, max_k: int) -> tuple[list[int], list[int]]:
        """The (B, W) shapes calibration times; other cells are interpolated between them."""
        bs = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch} | {1, max_batch})
        # W = 0 has no drafter and W = 1 adds it: the big step. Past that the cost grows about linearly in W.
        ws = sorted({0, 1, (1 + max_k) // 2, max_k})
        return bs, ws

    def calibrate(self, time_step: Callable[[int, int], float]) -> None:
        """Fill the table from time_step(B, W) -> seconds at the grid's shapes. For each B, the windows W >= 1 get
        the least-squares line through the timed ones (one noisy timing must not make a window look cheap: a cell
        the policy then never chooses would never be corrected); B in between is interpolated."""
        bs, ws = self.grid(self.max_batch, self.max_k)
        measured = {(b, w): time_step(b, w) for b in bs for w in ws}
        rows = {b: [measured[(b, 0)]] + _line([(w, measured[(b, w)]) for w in ws if w], self.max_k) for b in bs}
        for b in range(1, self.max_batch + 1):
            b0, b1 = _bracket(bs, b)
            self.base[b] = [_lerp(b, b0, b1, rows[b0][w], rows[b1][w]) for w in range(self.max_k + 1)]

    def predict(self, batch: int, window: int) -> float:
        return self.base[batch][window] * self.cell[batch][window] * self.drift

    def predict_row(self, batch: int) -> list[float]:
        """predict(batch, W) for W = 0..max_k, made non-decreasing in W: a wider window never costs less, and a
        noisy timing must not make it look so."""
        out, top = [], 0.0
        for w in range(self.max_k + 1):
            top = max(top, self.predict(batch, w))
            out.append(top)
        return out

    def observe(self, batch: int, window: int, seconds: float) -> None:
        base = self.base[batch][window]
        self.drift += COST_DRIFT_RATE * (seconds / (base * self.cell[batch][window]) - self.drift)
        self.cell[batch][window] += COST_CELL_RATE * (seconds / (base * self.drift) - self.cell[batch][window])


@dataclass
class Candidate:
    """One request as the policy sees it: its id and how many tokens it may still emit."""
    request_id: str
    remaining: int


class FixedK:
    """Always the configured K (vLLM's behaviour)."""

    name = "fixed"

    def __init__(self, k: int):
        self.max_k = k

    def choose(self, requests: Sequence[Candidate]) -> list[int]:
        return [self.max_k] * len(requests)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        pass

    def observe_step(self, batch: int, window: int, seconds: float) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class AdaptiveK:
    """The window that maximises expected tokens per second, from acceptance estimates and a step-cost model."""

    name = "adaptive"

    def __init__(self, max_k: int, max_batch: int, cost: StepCostModel | None = None):
        self.max_k = max_k
        self.cost = cost or StepCostModel(max_batch, max_k)
        self.engine_wide = AcceptanceEstimate(max_k, ENGINE_MEMORY)
        self.requests: dict[str, AcceptanceEstimate] = {}
        self.plain_steps_in_a_row = 0
        self.probe_after = PROBE_AFTER

    def estimate(self, request_id: str) -> AcceptanceEstimate:
        est = self.requests.get(request_id)
        if est is None:
            est = self.requests[request_id] = AcceptanceEstimate(self.max_k, REQUEST_MEMORY, prior=self.engine_wide)
        return est

    def gains(self, request: Candidate) -> list[float]:
        """E_b(W) - 1 for W = 0..max_k: the tokens a window of W drafts is expected to add to the target's one."""
        survival = self.estimate(request.request_id).survival()
        useful = max(0, min(self.max_k, request.remaining - 1))  # drafts past the request's last token emit nothing
        out, g = [0.0], 0.0
        for w in range(1, self.max_k + 1):
            if w <= useful:
                g += survival[w - 1]
            out.append(g)
        return out

    def choose(self, requests: Sequence[Candidate]) -> list[int]:
        """K per request: 0 for all, or W for the m requests that gain most from it and 0 for the rest (two
        target forwards), whichever promises the most tokens per second."""
        batch = len(requests)
        gains = [self.gains(r) for r in requests]
        rows = {b: self.cost.predict_row(b) for b in range(1, batch + 1)}
        plain = batch / rows[batch][0]
        best_rate, best_w, chosen = plain, 0, []
        for w in range(1, self.max_k + 1):
            order = sorted(range(batch), key=lambda i: -gains[i][w])
            tokens = float(batch)
            for m in range(1, batch + 1):
                tokens += gains[order[m - 1]][w]
                cost = rows[m][w] + (rows[batch - m][0] if m < batch else 0.0)
                if tokens / cost > best_rate:
                    best_rate, best_w, chosen = tokens / cost, w, order[:m]
        if best_w and best_rate >= SPECULATION_MARGIN * plain:
            self.plain_steps_in_a_row, self.probe_after = 0, PROBE_AFTER
            ks = [0] * batch
            for i in chosen:
                ks[i] = best_w
            self._age(requests, ks)
            return ks
        self.plain_steps_in_a_row += 1
        if self.plain_steps_in_a_row > self.probe_after and self.max_k:
            self.plain_steps_in_a_row = 0
            self.probe_after = min(2 * self.probe_after, PROBE_AFTER_MAX)
            return [1] * batch
        self._age(requests, [0] * batch)
        return [0] * batch

    def _age(self, requests: Sequence[Candidate], ks: list[int]) -> None:
        """Requests that take a plain step learn nothing from it; their estimates age instead."""
        for r, k in zip(requests, ks):
            if k == 0:
                self.estimate(r.request_id).age()

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.estimate(request_id).observe(num_drafted, num_accepted)
        self.engine_wide.observe(num_drafted, num_accepted)

    def observe_step(self, batch: int, window: int, seconds: float) -> None:
        self.cost.observe(batch, window, seconds)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


SpeculationPolicy = FixedK | AdaptiveK


def make_policy(name: str, max_k: int, max_batch: int) -> SpeculationPolicy:
    if name == "fixed":
        return FixedK(max_k)
    if name == "adaptive":
        return AdaptiveK(max_k, max_batch)
    raise ValueError(f"unknown speculation policy {name!r}: choose one of {', '.join(POLICIES)} "
                     f"(--speculation-policy or {ENV_VAR})")


def step_clock(device) -> Callable[[], float]:
    """The clock step costs are measured with. On a CPU, CPU time: on a machine shared with other processes, wall
    time mostly measures when the scheduler let us run, which is the same whatever K was chosen (one torch thread:
    this thread's time; several: the whole process's). On an accelerator, wall time after the queued work is done."""
    import torch

    if torch.device(device).type == "cpu":
        return time.thread_time if torch.get_num_threads() == 1 else time.process_time

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


def timed(fn: Callable[[], object], clock: Callable[[], float], repeats: int = 2) -> float:
    """The fastest of `repeats` runs of fn, in seconds of `clock` (after one untimed run that warms caches)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _line(points: list[tuple[int, float]], max_k: int) -> list[float]:
    """Values at 1..max_k of the least-squares line through points (never falling with W)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    return [my + slope * (w - mx) for w in range(1, max_k + 1)]


def _bracket(grid: list[int], x: int) -> tuple[int, int]:
    lo = max(g for g in grid if g <= x)
    hi = min(g for g in grid if g >= x)
    return lo, hi


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
