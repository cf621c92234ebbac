"""Full collections under `peagle serve`: none automatic; the start-up freeze at the first idle moment once listening;
then one when the engine is idle, one under load only after the bound (peagle/serve/idle_gc.py)."""
import gc

import pytest

from peagle.serve.idle_gc import IdleCollector, held_full_collections


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)
    gc.unfreeze()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def promote() -> None:
    """Something reaches the oldest generation: a young collection of generation 1."""
    gc.collect(1)


def test_take_over_keeps_the_young_thresholds(thresholds):
    gc.set_threshold(700, 10, 10)
    IdleCollector().take_over()
    young0, young1, oldest = gc.get_threshold()
    assert (young0, young1) == (700, 10) and oldest > 10**9


def test_freezes_start_up_once_listening_and_idle(thresholds):
    clock = Clock()
    collector = IdleCollector(settle_s=1, clock=clock).take_over()
    assert not collector.tick(idle=True)  # not listening yet
    clock.now = 5
    assert not collector.tick(idle=False)  # requests in flight: theirs would be frozen too
    assert collector.tick(idle=True) and collector.frozen and gc.get_freeze_count() > 0
    assert not collector.tick(idle=True)


def test_collects_when_idle_after_the_gap_and_under_load_after_the_bound(thresholds):
    clock = Clock()
    collector = IdleCollector(min_gap_s=30, bound_s=300, clock=clock).take_over()
    collector.frozen = True
    promote()
    assert not collector.tick(idle=True)  # the last full collection (the take-over) is too recent
    clock.now = 31
    assert not collector.tick(idle=False)  # busy: not before the bound
    assert collector.tick(idle=True) and gc.get_count()[2] == 0
    clock.now = 100
    assert not collector.tick(idle=True)  # nothing reached the oldest generation since
    promote()
    assert collector.tick(idle=True)
    promote()
    clock.now = 399
    assert not collector.tick(idle=False)
    clock.now = 400
    assert collector.tick(idle=False)
    assert collector.collections == 3


@pytest.mark.parametrize("taken_over", [False, True])
def test_no_automatic_full_collection(thresholds, taken_over):
    gc.set_threshold(700, 10, 10)
    if taken_over:
        IdleCollector().take_over()
    full = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(info)
    gc.callbacks.append(seen)
    try:
        kept = [[] for _ in range(300_000)]  # hundreds of young collections, each promoting survivors
    finally:
        gc.callbacks.remove(seen)
    assert len(kept) and (full == []) == taken_over  # CPython's own thresholds would have run some


def test_held_full_collections_gives_cpython_s_thresholds_back(thresholds):
    gc.set_threshold(700, 10, 10)
    with held_full_collections():
        assert gc.get_threshold()[2] > 10**9
    assert gc.get_threshold() == (700, 10, 10)
