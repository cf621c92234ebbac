"""What suffix drafts cost: `SuffixCache.speculate` and `add_tokens` per step on a ~1,000-token context, and the
shared tries' memory under a long stream of finished requests, on the embedded model's tokens of this repository's
own source and docs (docs/design.md, "Suffix drafts").

    python3 benchmarks/suffix_lookup.py [--requests 10000] [--context 1000] [--keys 8]

Step: a code-editing request whose prompt is a source file of ~`--context` tokens and whose answer copies it back,
one committed token per step; each step times add_tokens(1 token) and speculate(16 tokens) in thread CPU time
(other work on the machine does not count). Stream: `--requests` requests under `--keys` cache keys, each a chunk of
the same text as its output, through a cache at the default bounds; it reports the cache's own memory estimate and
the measured (tracemalloc) size at the end, and the time per request.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from tqdm import tqdm

from peagle.engine.proposers.suffix_tree import SuffixCache
from peagle.model.loading import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parent.parent


def corpus_tokens(tokenizer) -> list[list[int]]:
    files = sorted((ROOT / "peagle").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    return [tokenizer(f.read_text(encoding="utf-8")).input_ids for f in files]


def step_costs(tokens: list[int], context: int, cache: SuffixCache, key: str) -> dict[str, float]:
    prompt = tokens[:context]
    cache.start_request("edit", prompt, cache_key=key)
    spec_us, add_us, drafted = [], [], 0
    for t in prompt[:400]:  # the answer copies the file back: 400 steps, context 1,000 to 1,400 tokens
        t0 = time.thread_time_ns()
        cache.add_tokens("edit", [t])
        t1 = time.thread_time_ns()
        draft = cache.speculate("edit", 16)
        t2 = time.thread_time_ns()
        add_us.append((t1 - t0) / 1e3)
        spec_us.append((t2 - t1) / 1e3)
        drafted += len(draft.tokens)
    cache.abort_request("edit")
    spec_us.sort()
    return {"speculate_mean_us": statistics.fmean(spec_us), "speculate_p99_us": spec_us[int(0.99 * len(spec_us))],
            "add_token_mean_us": statistics.fmean(add_us), "drafted_per_step": drafted / len(spec_us)}


def stream(chunks: list[list[int]], requests: int, keys: int, seed: int) -> tuple[SuffixCache, dict[str, float]]:
    rng = random.Random(seed)
    cache = SuffixCache()
    peak, t0 = 0, time.process_time()
    for i in tqdm(range(requests), desc="requests", unit="req", mininterval=2):
        out = chunks[rng.randrange(len(chunks))]
        rid = f"r{i}"
        cache.start_request(rid, out[:32], cache_key=f"key{rng.randrange(keys)}")
        cache.add_tokens(rid, out)
        cache.stop_request(rid)
        if i % 100 == 0:
            peak = max(peak, cache.memory_bytes())
    spent = time.process_time() - t0
    return cache, {"requests": requests, "cpu_ms_per_request": 1e3 * spent / requests,
                   "peak_estimate_mb": max(peak, cache.memory_bytes()) / 2**20,
                   "cached_requests": cache.num_cached_requests, "cached_tokens": cache.num_cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    docs = corpus_tokens(load_tokenizer(resolve_model(None)))
    source = max(docs, key=len)
    print(f"corpus: {len(docs)} files, {sum(map(len, docs))} tokens; context file {len(source)} tokens")
    print("own tree only:", fmt(step_costs(source, args.context, SuffixCache(), "solo")))
    rng = random.Random(args.seed)
    chunks = []
    for d in docs:
        pos = 0
        while pos < len(d):
            n = rng.randint(50, 400)
            chunks.append(d[pos:pos + n])
            pos += n
    tracemalloc.start()
    cache, figures = stream(chunks, args.requests, args.keys, args.seed)
    measured = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    figures["measured_mb"] = measured / 2**20
    figures["estimate_mb"] = cache.memory_bytes() / 2**20
    print("stream:", fmt(figures))
    print("own + shared tree (key0):", fmt(step_costs(source, args.context, cache, "key0")))


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


if __name__ == "__main__":
    main()
