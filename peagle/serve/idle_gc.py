"""When `peagle serve` runs full garbage collections: while the engine is idle, not between two tokens
(docs/memory.md, "Pauses").

A full (oldest-generation) collection walks every object the collector tracks while holding the GIL, so every stream
stops. Start-up leaves about 207,000 (torch, the tokenizer, the model's modules, FastAPI), nearly all of them
for good: CPython's full collections while they were made walked the growing heap for nothing (five, 0.3-0.7 s in
all, before the server listened). So there are none from `peagle serve`'s first import on (peagle/cli.py holds them),
and at the first idle moment a second after start (the server listens by then) the engine thread collects once and
`gc.freeze()`s what is left, out of every later collection's reach; frozen objects are still freed when nothing
refers to them.

CPython also runs a full collection whenever the objects that survived since the last one reach a quarter of those
it tracks, wherever the process happens to be. The shared suffix trees alone are about 360,000 node objects at their
bytes cap, and each of those collections took 150-250 ms. The trees hold no reference cycles (an evicted node is
freed by its reference count), so a full collection finds only other code's rare cyclic garbage: a server can
choose when to look for it. Why not trees the collector never walks: nodes as indices into parallel arrays of ints
(which it skips) cost more per node visit than slotted objects in CPython 3.11 (172 ns with `array`, 78 with lists,
against 49), and the trees are walked for every token. So the young generations stay automatic (they walk only
recent objects: a few ms), and the oldest is collected here, by the engine thread between steps: when nothing is
running or waiting, at most every `min_gap_s`, and under load that never lets up at least every `bound_s`, so that
cyclic garbage stays bounded.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_NEVER = 2**31 - 1  # a generation-2 threshold the count of young collections never passes


def hold_full_collections() -> None:
    """No automatic full collections from here on; the young generations keep their thresholds."""
    gc.set_threshold(*gc.get_threshold()[:2], _NEVER)


@contextmanager
def held_full_collections() -> Iterator[None]:
    """No automatic full collections inside (IdleCollector runs them); CPython's thresholds come back after."""
    saved = gc.get_threshold()
    hold_full_collections()
    try:
        yield
    finally:
        gc.set_threshold(*saved)


class IdleCollector:
    def __init__(self, min_gap_s: float = 30.0, bound_s: float = 300.0, settle_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_gap_s, self.bound_s, self.settle_s, self.clock = min_gap_s, bound_s, settle_s, clock
        self.last = clock()
        self.frozen = False  # start-up's heap
        self.collections = 0  # full collections run here

    def take_over(self) -> "IdleCollector":
        """Run the full collections from now on, CPython's automatic ones stopped."""
        hold_full_collections()
        self.last = self.clock()
        return self

    def tick(self, idle: bool) -> bool:
        """Between engine steps: the start-up freeze at the first idle tick settle_s after take_over; then a full
        collection if objects reached the oldest generation since the last one and the engine is idle (the last one
        at least min_gap_s ago) or the last one is bound_s ago. True if it collected."""
        since = self.clock() - self.last
        if idle and not self.frozen and since >= self.settle_s:
            gc.collect()  # start-up's garbage goes first: frozen, it would never be collected
            gc.freeze()
            self.frozen = True
        elif gc.get_count()[2] == 0 or since < (self.min_gap_s if idle else self.bound_s):
            return False
        else:
            gc.collect()
        self.last = self.clock()
        self.collections += 1
        return True
