"""What full collections cost once the shared suffix trees reach their bytes cap (docs/memory.md, "Pauses"): the
start-up heap frozen as `peagle serve` freezes it, then the embedded model's own answers (data/heads) fed to a
SuffixCache as finished requests until it holds about 60 MB; prints the objects the collector tracks and three
timed gc.collect() calls. Then, as under load that never lets up, as many more answers again (every one evicts):
the longest collection CPython's automatic thresholds ran meanwhile, or with `--schedule` those left once
`peagle serve` takes full collections over (peagle/serve/idle_gc.py, ticked busy after each request), and the
milliseconds per answer.

    python scripts/pause_probe/suffix_gc.py [--schedule]
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import time
from pathlib import Path

from peagle.engine.proposers.suffix_tree import SuffixCache
from peagle.model.loading import load_tokenizer
from peagle.model.speculation import resolve_speculation
from peagle.serve.idle_gc import IdleCollector

DATA = Path(__file__).resolve().parents[2] / "data" / "heads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", action="store_true", help="full collections as peagle serve schedules them")
    args = ap.parse_args()
    tok = load_tokenizer(resolve_speculation(None, None).model_path)
    outputs = [tok(m["content"], add_special_tokens=False)["input_ids"][:512]
               for name in ("smollm2-regenerated.jsonl.gz", "smollm2-regenerated-code.jsonl.gz")
               for line in gzip.open(DATA / name, "rt") for m in json.loads(line)["messages"]
               if m["role"] == "assistant"]
    gc.collect()
    gc.freeze()  # as peagle serve does after start-up
    before = len(gc.get_objects())
    collector = IdleCollector().take_over() if args.schedule else None
    cache, i = SuffixCache(max_tree_depth=24, max_cached_requests=10000), 0

    def answer() -> None:
        nonlocal i
        cache.start_request(f"r{i}", [1, 2, 3])
        cache.add_tokens(f"r{i}", outputs[i % len(outputs)])
        cache.stop_request(f"r{i}")
        i += 1
        if collector is not None:
            collector.tick(idle=False)

    while cache.memory_bytes() < 60 * 2**20 and i < 3 * len(outputs):
        answer()
    filled = i
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append(round((time.perf_counter() - t0) * 1e3))
    tracked = len(gc.get_objects()) - before
    pauses: list[tuple[int, float]] = []
    started = {}

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started["t"]) * 1e3))
    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    while i < 2 * filled:
        answer()
    ms_per_answer = (time.perf_counter() - t0) * 1e3 / filled
    gc.callbacks.remove(timed)
    print(json.dumps({"outputs": filled, "cached_tokens": cache.num_cached_tokens,
                      "suffix_mb": round(cache.memory_bytes() / 2**20, 1), "tracked_objects": tracked,
                      "full_collection_ms": times, "schedule": "idle_gc" if collector else "cpython",
                      "at_cap": {"answers": filled, "collections": len(pauses),
                                 "full": sum(g == 2 for g, _ in pauses),
                                 "longest_ms": round(max((ms for _, ms in pauses), default=0.0), 1),
                                 "ms_per_answer": round(ms_per_answer, 2)}}))


if __name__ == "__main__":
    main()
