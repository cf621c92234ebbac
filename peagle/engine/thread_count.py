"""How many threads each decode step runs on, chosen from the steps' measured wall time (docs/engine.md, "Threads").

On a machine whose cores other processes also use, two threads can decode slower than one: peagle's kernels split
every matrix evenly between the threads, and each parallel region ends at a barrier, so every region waits for the
thread that shares its core with other work. On a quiet machine two threads decode up to 1.8x faster than one. The
load changes while a server runs, so the count is chosen at run time: the engine runs on its current count, now and
then probes the neighbouring count, and moves to it when its steps were faster. Wall time, not CPU time: CPU time
does not see the waiting.

A probe alternates steps on the other count with steps on the current one, and compares each step on the other
count with the mean of the current count's steps of the same shape just before and just after it: other work on a
shared machine comes and goes within a fraction of a second, and neighbouring steps see nearly the same load. The
count moves when the median of PROBE_STEPS such ratios shows a gain of MARGIN or more (hysteresis against noise).
A probe comes after a stretch of decoding that doubles each time a probe finds the current count still the faster
(from PROBE_AFTER_S up to PROBE_AFTER_MAX_S), so a settled engine spends a few steps in a thousand on the other
count; and sooner when the current count's steps get DRIFT times slower than after the last probe (other work
started), though not within DRIFT_AFTER_S of decoding of the last probe, so load that comes and goes every few
steps costs at most a probe per DRIFT_AFTER_S.

peagle's kernels compute every row's result the same way whatever the thread count, so switching between steps
changes no output; PyTorch's kernels make no such promise, so where they run the count stays fixed.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Hashable

from peagle import threads

PROBE_STEPS = 4  # steps a probe times on the other count, each between two on the current count
PROBE_MAX_STEPS = 16  # a probe ends after this many steps even if too few had a neighbour of the same shape
PROBE_AFTER_S = 0.5  # seconds of decoding before the first probe, and after the count moved
PROBE_AFTER_MAX_S = 32.0  # the longest stretch between probes (their cost on a quiet machine: under 0.5%)
MARGIN = 0.05  # move only to a count whose steps took at most 95% of the current count's
DRIFT = 1.3  # probe sooner when the current count's steps take 1.3x what they took after the last probe
DRIFT_STEPS = 8  # the current count's latest steps of a shape, whose median is compared with the first after a probe
DRIFT_AFTER_S = 2.0  # seconds of decoding after a probe before a drift may start the next


class ThreadCount:
    """Chooses the thread count of each decode step between 1 and `most` from wall-time step costs fed to it
    (`observe`); holds no clock and sets nothing, so its decisions can be tested on synthetic timings."""

    def __init__(self, most: int):
        self.most = most
        self.current = most
        self.probing: int | None = None  # the count a probe compares with the current one
        self._on_probed = False  # whether the step `next_count` gave runs on the probed count
        self._ratios: list[float] = []  # a probed step's time over its current-count neighbours'
        self._probe_steps = 0
        self._waiting: tuple[Hashable, float, float | None] | None = None  # a probed step, before its next neighbour
        self._last: tuple[Hashable, float] | None = None  # the latest step on the current count
        self._recent: deque[tuple[Hashable, float]] = deque(maxlen=DRIFT_STEPS)
        # the current count's step time per shape after the last probe (the median of its first DRIFT_STEPS)
        self._reference: dict[Hashable, float] = {}
        self._probe_after = PROBE_AFTER_S
        self._since_probe = 0.0  # seconds of decoding since the last probe ended
        self._down = True  # which neighbour the next probe tries, where there are two
        self.probes = self.moves = 0

    def next_count(self) -> int:
        """The count the next decode step runs on."""
        if self.probing is None and self.most > 1 and (self._since_probe >= self._probe_after or self._drifted()):
            self._start_probe()
        if self.probing is not None:
            self._on_probed = not self._on_probed
            return self.probing if self._on_probed else self.current
        return self.current

    def observe(self, shape: Hashable, seconds: float) -> None:
        """A decode step's wall time, on the count `next_count` gave. `shape`: what makes two steps' work the same
        (the rows verified, the windows drafted, the drafts per window); only steps of one shape are compared."""
        if self.probing is None:
            self._since_probe += seconds
            self._recent.append((shape, seconds))
            times = self._latest(shape)
            if shape not in self._reference and times is not None:
                self._reference[shape] = statistics.median(times)
        elif self._on_probed:
            before = self._last[1] if self._last is not None and self._last[0] == shape else None
            self._waiting = (shape, seconds, before)
        else:
            if self._waiting is not None and self._waiting[0] == shape:
                _, probed, before = self._waiting
                neighbours = (before, seconds) if before is not None else (seconds,)
                self._ratios.append(probed / statistics.fmean(neighbours))
            self._waiting = None
        if self.probing is None or not self._on_probed:
            self._last = (shape, seconds)
        if self.probing is not None:
            self._probe_steps += 1
            if len(self._ratios) >= PROBE_STEPS or self._probe_steps >= PROBE_MAX_STEPS:
                self._end_probe()

    def _latest(self, shape: Hashable) -> list[float] | None:
        """The current count's latest DRIFT_STEPS step times, if all were of `shape`."""
        times = [t for s, t in self._recent if s == shape]
        return times if len(times) == DRIFT_STEPS else None

    def _drifted(self) -> bool:
        """Whether the current count's latest steps took DRIFT times as long as the first after the last probe."""
        if not self._recent or self._since_probe < DRIFT_AFTER_S:
            return False
        shape = self._recent[-1][0]
        times = self._latest(shape)
        return times is not None and shape in self._reference and statistics.median(times) > DRIFT * \
            self._reference[shape]

    def _start_probe(self) -> None:
        if self.current == self.most or (self.current > 1 and self._down):
            self.probing = self.current - 1
        else:
            self.probing = self.current + 1
        self._down = not self._down
        self._on_probed, self._ratios, self._probe_steps, self._waiting = False, [], 0, None
        self.probes += 1

    def _end_probe(self) -> None:
        """Move to the probed count if its steps were the faster by MARGIN; else keep the count and wait twice as
        long for the next probe. Either way the drift reference starts again from the steps that follow."""
        probed, self.probing, self._since_probe = self.probing, None, 0.0
        self._recent.clear()
        self._reference = {}
        if len(self._ratios) < PROBE_STEPS:  # too few steps of one shape side by side: decide nothing
            return
        if statistics.median(self._ratios) <= 1 - MARGIN:
            self.current, self.moves, self._last = probed, self.moves + 1, None
            self._probe_after = PROBE_AFTER_S
        else:
            self._probe_after = min(2 * self._probe_after, PROBE_AFTER_MAX_S)


class StepThreads:
    """The engine's side: runs each decode step on the count a ThreadCount chooses and times it, while the count is
    peagle's to choose (threads.adaptive: no OMP_NUM_THREADS, --threads or torch.set_num_threads chose it) and
    `switchable` (peagle's kernels run the forward: their results do not depend on the count)."""

    def __init__(self, switchable: bool):
        most = threads.default_threads()
        self.choice = ThreadCount(most) if switchable and most > 1 else None
        self._started: float | None = None
        if self.choice is not None and threads.adaptive():
            # start-up's timings (and the step clock, which follows the count) are taken on the count it starts on,
            # whatever another engine in this process moved it to
            threads.set_adaptive_count(most)

    def start_step(self) -> None:
        self._started = None
        if self.choice is not None and threads.adaptive():
            threads.set_adaptive_count(self.choice.next_count())
            self._started = time.perf_counter()

    def end_step(self, shape: Hashable) -> None:
        if self._started is not None:
            self.choice.observe(shape, time.perf_counter() - self._started)

    def summary(self) -> dict:
        """For stats: the count steps run on now, and how often it was probed and moved (absent when fixed)."""
        if self.choice is None or not threads.adaptive():
            return {}
        c = self.choice
        return {"threads_now": c.current, "thread_probes": c.probes, "thread_moves": c.moves}
