"""Where a `peagle serve` process's pauses and memory go, as JSON lines (docs/memory.md, "Pauses"). Put this folder
first on PYTHONPATH and name a log file in PEAGLE_PAUSE_LOG; every `peagle serve` started with that environment
(benchmarks/serve.py soak's too) then logs:
  gc        each cyclic collection over 20 ms: generation, milliseconds, the thread it stopped;
  step      every engine step: milliseconds, the gap since the last one, collections inside it, requests running;
  slow_step a step over 3x the median of recent ones, with the milliseconds of each engine phase it ran;
  loop_lag  the event loop late by over 100 ms (a pause that stops the HTTP side too);
  sample    every 5 s: resident memory, the KV pool's touched and free blocks, the prefix cache's blocks, the shared
            suffix trees' bytes; every 60 s the objects the collector tracks and the commonest types.
Diagnostic only: the wrappers cost a little per step, and counting the tracked objects is itself a short pause."""
from __future__ import annotations

import collections
import gc
import itertools
import json
import os
import statistics
import sys
import threading
import time

LOG = os.environ.get("PEAGLE_PAUSE_LOG")
_lock = threading.Lock()
_gc = {"start": 0.0, "total": 0.0}
_phases: dict[str, float] = {}
_state: dict = {"engine": None, "durations": [], "last_end": None}


def emit(kind: str, **fields) -> None:
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps({"t": round(time.perf_counter(), 3), "kind": kind, **fields}) + "\n")


def on_gc(phase: str, info: dict) -> None:
    now = time.perf_counter()
    if phase == "start":
        _gc["start"] = now
        return
    _gc["total"] += now - _gc["start"]
    if now - _gc["start"] > 0.02:
        emit("gc", gen=info["generation"], ms=round((now - _gc["start"]) * 1e3, 1),
             thread=threading.current_thread().name)


def timed(cls, name: str) -> None:
    """Add the method's time, on the engine thread, to this step's phases."""
    fn, label = getattr(cls, name), f"{cls.__name__}.{name}"

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if threading.current_thread().name == "peagle-engine":
                _phases[label] = _phases.get(label, 0.0) + time.perf_counter() - t
    setattr(cls, name, wrapper)


def patch() -> None:
    """Wrap the engine once the server has imported it (the class attributes are looked up on every call)."""
    while "peagle.serve.async_engine" not in sys.modules:
        time.sleep(0.2)
    time.sleep(0.5)
    from peagle.engine.catch_up import DrafterCatchUp
    from peagle.engine.engine import LLMEngine
    from peagle.engine.prefill import Prefill
    from peagle.engine.prefix_cache import PrefixCache
    from peagle.model.layers import KVCache
    from peagle.serve.async_engine import AsyncEngine

    for name in ("_take_incoming", "_admit", "_make_room", "_plan", "_decode_step", "_retire_if_finished"):
        timed(LLMEngine, name)
    timed(Prefill, "step")
    timed(DrafterCatchUp, "before_drafting")
    for name in ("free_blocks", "_evict", "store"):
        timed(PrefixCache, name)
    timed(KVCache, "ensure")
    step = LLMEngine.step

    def step_wrapper(self, *args, **kwargs):
        _state["engine"] = self
        _phases.clear()
        g0, t = _gc["total"], time.perf_counter()
        gap = t - _state["last_end"] if _state["last_end"] is not None else 0.0
        try:
            return step(self, *args, **kwargs)
        finally:
            end = _state["last_end"] = time.perf_counter()
            ms, durations = (end - t) * 1e3, _state["durations"]
            durations[:] = durations[-99:] + [ms]
            emit("step", ms=round(ms, 1), gap=round(gap * 1e3, 1), gc=round((_gc["total"] - g0) * 1e3, 1),
                 running=len(self.running))
            if len(durations) > 20 and ms > 3 * statistics.median(durations):
                emit("slow_step", ms=round(ms, 1), running=len(self.running), waiting=len(self.waiting),
                     phases={k: round(v * 1e3, 1) for k, v in sorted(_phases.items(), key=lambda kv: -kv[1])
                             if v > 0.002})
    LLMEngine.step = step_wrapper
    start = AsyncEngine.start

    def start_wrapper(self) -> None:
        start(self)
        import asyncio

        async def lag() -> None:
            while True:
                t, g0 = time.perf_counter(), _gc["total"]
                await asyncio.sleep(0.01)
                late = time.perf_counter() - t - 0.01
                if late > 0.1:
                    emit("loop_lag", ms=round(late * 1e3, 1), gc_ms=round((_gc["total"] - g0) * 1e3, 1))
        self._pause_probe = asyncio.get_running_loop().create_task(lag())
    AsyncEngine.start = start_wrapper


def sample() -> None:
    for i in itertools.count():
        time.sleep(5)
        rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
        row: dict = {"rss_mb": round(rss / 2**20, 1)}
        engine = _state["engine"]
        if engine is not None:
            cache, prefix = engine.target_cache, engine.prefix_cache
            row.update(kv_touched=cache.num_touched_blocks, kv_free=cache.num_free_blocks,
                       kv_block_bytes=sum(c.bytes_per_block for c in (cache, engine.drafter_cache) if c is not None))
            if prefix is not None:
                row.update(prefix_blocks=prefix.num_cached_blocks, prefix_block_bytes=prefix.bytes_per_block)
            suffix = getattr(getattr(engine.proposer, "suffix", engine.proposer), "cache", None)
            if hasattr(suffix, "memory_bytes"):
                row["suffix_mb"] = round(suffix.memory_bytes() / 2**20, 1)
        if i % 12 == 11:
            objects = gc.get_objects()
            row.update(tracked=len(objects), frozen=gc.get_freeze_count(),
                       types=collections.Counter(type(o).__name__ for o in objects).most_common(5))
            del objects
        emit("sample", **row)


if LOG and "serve" in sys.argv:
    gc.callbacks.append(on_gc)
    threading.Thread(target=patch, daemon=True).start()
    threading.Thread(target=sample, daemon=True).start()
