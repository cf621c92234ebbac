"""Full garbage collections while the engine is idle, not between two tokens (docs/memory.md, "Pauses").

CPython runs a full (oldest-generation) collection whenever the objects that survived since the last one reach a
quarter of those it tracks, wherever the process happens to be: it holds the GIL throughout, so every stream stops.
The shared suffix trees alone are about 360,000 node objects at their bytes cap, and each of those collections took
150-220 ms. The trees hold no reference cycles (an evicted node is freed by its reference count), so a full
collection finds only other code's rare cyclic garbage: a server can choose when to look for it.

Why not trees the collector never walks: nodes as indices into parallel arrays of ints (which it skips) cost more
per node visit than slotted objects in CPython 3.11 (172 ns with `array`, 78 with lists, against 49), and the trees
are walked for every token. So the young generations stay automatic (they walk only recent objects: a few ms), the
oldest is collected here, by the engine thread between steps: when nothing is running or waiting, at most every
`min_gap_s`, and under load that never lets up at least every `bound_s`, so that cyclic garbage stays bounded.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable

_NEVER = 2**31 - 1  # a generation-2 threshold the count of young collections never passes


class IdleCollector:
    def __init__(self, min_gap_s: float = 30.0, bound_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_gap_s, self.bound_s, self.clock = min_gap_s, bound_s, clock
        self.last = clock()
        self.collections = 0  # full collections run here

    def take_over(self) -> "IdleCollector":
        """Stop CPython's automatic full collections (the young generations keep their thresholds)."""
        gc.set_threshold(*gc.get_threshold()[:2], _NEVER)
        self.last = self.clock()
        return self

    def tick(self, idle: bool) -> bool:
        """Between engine steps: a full collection if objects reached the oldest generation since the last one and
        the engine is idle (the last one at least min_gap_s ago) or the last one is bound_s ago. True if it ran."""
        since = self.clock() - self.last
        if gc.get_count()[2] == 0 or since < (self.min_gap_s if idle else self.bound_s):
            return False
        gc.collect()
        self.last = self.clock()
        self.collections += 1
        return True
