"""How the engine times its forwards: the clock a step's cost is measured with, and the best of a few runs (the
speculation policy's and the step budget's start-up calibrations, and the head's drafting, all use them)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def step_clock(device) -> Callable[[], float]:
    """The clock step costs are measured with. On a CPU, CPU time: on a machine shared with other processes, wall
    time mostly measures when the scheduler let us run, which is the same whatever K was chosen (one torch thread:
    this thread's time; several: the whole process's). On an accelerator, wall time after the queued work is done."""
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
