"""What suffix drafts cost: `SuffixCache.speculate` and `add_tokens` per step on a ~1,000-token context, and the
shared tries' memory under a long stream of finished requests, on the embedded model's tokens of this repository's
own source and docs (docs/design.md, "Suffix drafts").

    python3 benchmarks/suffix_lookup.py [--requests 10000] [--context 1000] [--keys 8]

Step: a code-editing request whose prompt is a source file of ~`--context` tokens and whose answer copies it back,
one committed token per step; each step times add_tokens(1 token) and speculate(16 tokens) in thread CPU time
(other work on the machine does not count). Stream: `--requests` requests under `--keys` cache keys, each a chunk
(50 to 400 tokens) of the same text as its output, through a cache at the default bounds; it reports the peak of the
cache's memory estimate over the stream, the measured (tracemalloc) size at its end, and then the CPU time per
request (start, add the output, stop: insert and evict) over 200 more, without tracemalloc.
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


def step_costs(tokens: list[int], context: int, cache: SuffixCache, key: str, arctic=None) -> dict[str, float]:
    """Per step of the copying answer: our add_tokens and speculate, and (with `arctic`, an Arctic Inference
    SuffixDecodingCache) the same two calls of theirs in the same step, so both see the same machine load."""
    prompt = tokens[:context]
    cache.start_request("edit", prompt, cache_key=key)
    if arctic is not None:
        arctic.start_request("edit", prompt)
    times: dict[str, list[float]] = {"speculate": [], "add_token": [], "arctic_speculate": [], "arctic_add_token": []}
    drafted = arctic_drafted = 0
    context_ids = list(prompt)
    for t in prompt[:400]:  # the answer copies the file back: 400 steps, context 1,000 to 1,400 tokens
        context_ids.append(t)
        t0 = time.thread_time_ns()
        cache.add_tokens("edit", [t])
        t1 = time.thread_time_ns()
        draft = cache.speculate("edit", 16)
        t2 = time.thread_time_ns()
        times["add_token"].append((t1 - t0) / 1e3)
        times["speculate"].append((t2 - t1) / 1e3)
        drafted += len(draft.tokens)
        if arctic is not None:
            tail = context_ids[-cache.max_tree_depth:]
            t0 = time.thread_time_ns()
            arctic.add_active_response("edit", [t])
            t1 = time.thread_time_ns()
            theirs = arctic.speculate("edit", tail, max_spec_tokens=16, max_spec_factor=1.0, min_token_prob=0.1)
            t2 = time.thread_time_ns()
            times["arctic_add_token"].append((t1 - t0) / 1e3)
            times["arctic_speculate"].append((t2 - t1) / 1e3)
            arctic_drafted += len(theirs.token_ids)
    cache.abort_request("edit")
    out = {}
    for name, values in times.items():
        if values:
            values.sort()
            out[f"{name}_mean_us"] = statistics.fmean(values)
            out[f"{name}_p99_us"] = values[int(0.99 * len(values))]
    out["drafted_per_step"] = drafted / len(times["speculate"])
    if arctic is not None:
        arctic.stop_request("edit")
        out["arctic_drafted_per_step"] = arctic_drafted / len(times["speculate"])
    return out


def stream(cache: SuffixCache, chunks: list[list[int]], requests: int, keys: int, rng: random.Random) -> int:
    """Run `requests` finished requests through the cache; the peak of its memory estimate."""
    peak = 0
    for i in tqdm(range(requests), desc="requests", unit="req", mininterval=2):
        out = chunks[rng.randrange(len(chunks))]
        rid = f"r{i}"
        cache.start_request(rid, out[:32], cache_key=f"key{rng.randrange(keys)}")
        cache.add_tokens(rid, out)
        cache.stop_request(rid)
        peak = max(peak, cache.memory_bytes())
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arctic", action="store_true",
                    help="also time Arctic Inference's SuffixDecodingCache in the same steps (needs arctic-inference)")
    args = ap.parse_args()
    arctic = None
    if args.arctic:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        arctic = SuffixDecodingCache(max_tree_depth=SuffixCache().max_tree_depth, max_cached_requests=-1)
    docs = corpus_tokens(load_tokenizer(resolve_model(None)))
    source = max(docs, key=len)
    print(f"corpus: {len(docs)} files, {sum(map(len, docs))} tokens; context file {len(source)} tokens")
    print("own tree only:", fmt(step_costs(source, args.context, SuffixCache(), "solo", arctic)))
    rng = random.Random(args.seed)
    chunks = []
    for d in docs:
        pos = 0
        while pos < len(d):
            n = rng.randint(50, 400)
            chunks.append(d[pos:pos + n])
            pos += n
    cache = SuffixCache()
    tracemalloc.start()
    peak = stream(cache, chunks, args.requests, args.keys, rng)
    measured = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    t0 = time.process_time()  # at steady state (full cache: every stop evicts), without tracemalloc's overhead
    stream(cache, chunks, 200, args.keys, rng)
    steady_ms = (time.process_time() - t0) * 1e3 / 200
    print("stream:", fmt({"requests": args.requests, "peak_estimate_mb": peak / 2**20,
                          "final_estimate_mb": cache.memory_bytes() / 2**20, "measured_mb": measured / 2**20,
                          "cached_requests": cache.num_cached_requests, "cached_tokens": cache.num_cached_tokens,
                          "cpu_ms_per_request_at_steady_state": steady_ms,
                          "mean_output_tokens": statistics.fmean(map(len, chunks))}))
    print("own + shared tree (key0):", fmt(step_costs(source, args.context, cache, "key0")))


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


if __name__ == "__main__":
    main()
