"""How many threads each decode step runs on, chosen from the steps' measured wall time (docs/engine.md, "Threads").

On a machine whose cores other processes also use, two threads can decode slower than one: peagle's kernels split
every matrix evenly between the threads, and each parallel region ends at a barrier, so every region waits for the
thread that shares its core with other work. On a quiet machine two threads decode up to 1.8x faster than one. The
load changes while a server runs, so the count is chosen at run time: the engine runs on its current count, now and
then runs a few steps on the neighbouring count (a probe), and moves to it when those steps were faster than the
current count's steps of the same shape just before. Wall time, not CPU time: CPU time does not see the waiting.

A probe comes after a stretch of decoding that doubles each time a probe finds the current count still the faster
(from PROBE_AFTER_S up to PROBE_AFTER_MAX_S), so a settled engine spends a few steps in a thousand on the other
count; it comes at once when the current count's steps get DRIFT times slower than when it was last compared (other
work started). The count moves only for a gain of MARGIN or more (hysteresis against noise).

peagle's kernels compute every row's result the same way whatever the thread count, so switching between steps
changes no output; PyTorch's kernels make no such promise, so where they run the count stays fixed.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Hashable

from peagle import threads

PROBE_STEPS = 3  # steps a probe times on the other count
PROBE_MAX_STEPS = 8  # a probe gives up when this many steps had no step of the same shape to compare with
PROBE_AFTER_S = 0.5  # seconds of decoding before the first probe, and after the count moved
PROBE_AFTER_MAX_S = 16.0  # the longest stretch between probes (the probes' cost: a few steps per stretch)
MARGIN = 0.05  # move only to a count whose steps took at most 95% of the current count's
DRIFT = 1.3  # probe at once when the current count's steps take 1.3x what they took at the last comparison
RECENT_STEPS = 8  # the current count's latest steps, what a probe is compared with


class ThreadCount:
    """Chooses the thread count of each decode step between 1 and `most` from wall-time step costs fed to it
    (`observe`); holds no clock and sets nothing, so its decisions can be tested on synthetic timings."""

    def __init__(self, most: int):
        self.most = most
        self.current = most
        self.probing: int | None = None  # the count a probe is running on
        self._probe: list[tuple[Hashable, float]] = []
        self._probe_steps = 0
        self._recent: deque[tuple[Hashable, float]] = deque(maxlen=RECENT_STEPS)
        self._reference: dict[Hashable, float] = {}  # the current count's step time per shape at the last comparison
        self._probe_after = PROBE_AFTER_S
        self._since_probe = 0.0  # seconds of decoding since the last probe ended
        self._down = True  # which neighbour the next probe tries, where there are two
        self.probes = self.moves = 0

    def next_count(self) -> int:
        """The count the next decode step runs on."""
        if self.probing is None and self.most > 1 and (self._since_probe >= self._probe_after or self._drifted()):
            self._start_probe()
        return self.probing or self.current

    def observe(self, shape: Hashable, seconds: float) -> None:
        """A decode step's wall time, on the count `next_count` gave. `shape`: what makes two steps' work the same
        (the rows verified, the windows drafted, the drafts per window); only steps of one shape are compared."""
        if self.probing is None:
            self._recent.append((shape, seconds))
            self._since_probe += seconds
            return
        self._probe_steps += 1
        if any(s == shape for s, _ in self._recent):
            self._probe.append((shape, seconds))
        if len(self._probe) >= PROBE_STEPS or self._probe_steps >= PROBE_MAX_STEPS:
            self._end_probe()

    def _drifted(self) -> bool:
        """Whether the current count's latest steps of one shape take DRIFT times their time at the last comparison
        (a few steps of that shape, so one slow step is not a drift)."""
        for shape, ref in self._reference.items():
            times = [t for s, t in self._recent if s == shape]
            if len(times) >= PROBE_STEPS and statistics.median(times) > DRIFT * ref:
                return True
        return False

    def _start_probe(self) -> None:
        if self.current == self.most or (self.current > 1 and self._down):
            self.probing = self.current - 1
        else:
            self.probing = self.current + 1
        self._down = not self._down
        self._probe, self._probe_steps = [], 0
        self.probes += 1

    def _end_probe(self) -> None:
        """Compare the probe's steps with the current count's latest steps of the same shapes; move, or keep the
        count and wait twice as long for the next probe."""
        mine = {}
        for shape, t in self._recent:
            mine.setdefault(shape, []).append(t)
        baseline = {s: statistics.median(ts) for s, ts in mine.items()}
        ratios = [t / baseline[s] for s, t in self._probe]
        probed, self.probing, self._since_probe = self.probing, None, 0.0
        if len(ratios) < PROBE_STEPS:  # too few steps of a shape the current count ran: decide nothing
            return
        if statistics.median(ratios) <= 1 - MARGIN:
            self.current, self.moves = probed, self.moves + 1
            self._recent.clear()
            self._recent.extend(self._probe)
            self._reference = {}
            for shape, t in self._probe:
                self._reference.setdefault(shape, []).append(t)
            self._reference = {s: statistics.median(ts) for s, ts in self._reference.items()}
            self._probe_after = PROBE_AFTER_S
        else:
            self._reference = baseline
            self._probe_after = min(2 * self._probe_after, PROBE_AFTER_MAX_S)


class StepThreads:
    """The engine's side: runs each decode step on the count a ThreadCount chooses and times it, while the count is
    peagle's to choose (threads.adaptive: no OMP_NUM_THREADS, --threads or torch.set_num_threads chose it) and
    `switchable` (peagle's kernels run the forward: their results do not depend on the count)."""

    def __init__(self, switchable: bool):
        most = threads.default_threads()
        self.choice = ThreadCount(most) if switchable and most > 1 else None
        self._started: float | None = None

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
        if self.choice is None:
            return {}
        c = self.choice
        return {"threads_now": c.current, "thread_probes": c.probes, "thread_moves": c.moves}
