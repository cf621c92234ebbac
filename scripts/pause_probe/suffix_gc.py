"""What one full collection costs once the shared suffix trees reach their bytes cap (docs/memory.md, "Pauses"): the
start-up heap frozen as `peagle serve` freezes it, then the embedded model's own answers (data/heads) fed to a
SuffixCache as finished requests until it holds about 60 MB; prints the objects the collector tracks and three
timed gc.collect() calls.

    python scripts/pause_probe/suffix_gc.py
"""
from __future__ import annotations

import gc
import gzip
import json
import time
from pathlib import Path

from peagle.engine.proposers.suffix_tree import SuffixCache
from peagle.model.loading import load_tokenizer
from peagle.model.speculation import resolve_speculation

DATA = Path(__file__).resolve().parents[2] / "data" / "heads"


def main() -> None:
    tok = load_tokenizer(resolve_speculation(None, None).model_path)
    outputs = [tok(m["content"], add_special_tokens=False)["input_ids"][:512]
               for name in ("smollm2-regenerated.jsonl.gz", "smollm2-regenerated-code.jsonl.gz")
               for line in gzip.open(DATA / name, "rt") for m in json.loads(line)["messages"]
               if m["role"] == "assistant"]
    gc.collect()
    gc.freeze()  # as peagle serve does after start-up
    before = len(gc.get_objects())
    cache, i = SuffixCache(max_tree_depth=24, max_cached_requests=10000), 0
    while cache.memory_bytes() < 60 * 2**20 and i < 3 * len(outputs):
        cache.start_request(f"r{i}", [1, 2, 3])
        cache.add_tokens(f"r{i}", outputs[i % len(outputs)])
        cache.stop_request(f"r{i}")
        i += 1
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append(round((time.perf_counter() - t0) * 1e3))
    print(json.dumps({"outputs": i, "cached_tokens": cache.num_cached_tokens,
                      "suffix_mb": round(cache.memory_bytes() / 2**20, 1),
                      "tracked_objects": len(gc.get_objects()) - before, "full_collection_ms": times}))


if __name__ == "__main__":
    main()
