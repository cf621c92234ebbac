"""Component costs, one subcommand each, all on the embedded SmolLM2 unless told otherwise. Every subcommand runs
torch on --threads threads (default 1) and then times CPU time of this process (on a shared machine other work does
not count; wall time with more threads); where it compares things, their calls alternate (a b b a ...) so that load
from other processes hits all of them alike. Each prints its kernels, threads and the load average.

    python3 benchmarks/micro.py quant [--formats q4_0 q8_0] [--rows 1 4 8]   # the block-quantized kernel alone
    python3 benchmarks/micro.py forward --hf                  # the target's forward against transformers', bf16
    python3 benchmarks/micro.py forward --formats bf16 gguf q4_0 q8_0       # every weight format side by side
    PEAGLE_CPU_KERNELS=avx2 python3 benchmarks/micro.py forward ...         # the AVX2 paths on a wider CPU
    python3 benchmarks/micro.py matmul                        # fp32 against bf16 matmuls (`peagle train --dtype auto`)
    python3 benchmarks/micro.py verify --batch 8              # one verify forward against split and ragged windows
    python3 benchmarks/micro.py suffix                        # suffix-tree lookups and its memory over a stream
    python3 benchmarks/micro.py accuracy                      # perplexity and top-1 agreement per weight format
    python3 benchmarks/micro.py memory                        # resident memory of an engine per weight format
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("q4_0", "q4_1", "q8_0")


# ---- the shared harness: threads, the clock, interleaved timing, the header line

def clock_for(threads: int) -> Callable[[], float]:
    """CPU time of this process on one thread (other processes holding the core do not count); wall time else."""
    return time.process_time if threads == 1 else time.perf_counter


def interleaved(fns: dict[str, Callable[[], object]], iters: int, clock: Callable[[], float],
                warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of every call of each function, the calls alternating a b b a ... so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for i in range(iters):
        for name in order if i % 2 == 0 else order[::-1]:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return times


def header(args, what: str) -> None:
    from peagle.model import kernels

    print(f"{what}; {kernels.describe()}; {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time; "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)


def footer() -> None:
    print(f"load average at end {os.getloadavg()[0]:.2f} (compare figures within a run, not across runs)")


def filled_cache(model, batch: int, context: int, extra: int, seed: int = 0):
    """A cache of `batch` rows holding `context` random tokens each, with room for `extra` more."""
    from peagle.model.layers import BatchLayout

    cache = model.new_cache(batch, context + extra)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, model.config.vocab_size, (batch, context), generator=g)
    with torch.inference_mode():
        model(prompt, BatchLayout.build(torch.arange(batch), torch.arange(context)[None].expand(batch, -1)), cache)
    return cache


def decode_rows(model, cache, context: int, rows: int, batch: int = 1) -> Callable[[], object]:
    """One forward of `rows` query rows per request after `context` cached tokens, logits for every row (as
    verification needs)."""
    from peagle.model.layers import BatchLayout

    tokens = torch.randint(100, model.config.vocab_size, (batch, rows), generator=torch.Generator().manual_seed(rows))
    layout = BatchLayout.build(torch.arange(batch), (context + torch.arange(rows))[None].expand(batch, -1))

    def run():
        with torch.inference_mode():
            return model(tokens, layout, cache, num_logits=None)
    return run


# ---- quant: the block-quantized matrix kernel alone

def quant(args) -> None:
    """Per format and row count: the kernel with its weights hot in cache (arithmetic) and streaming from memory
    (cold: a pool of distinct matrices above the last-level cache, as a forward streams its layers). Microseconds a
    call (fastest of --repeats x --calls), nanoseconds per row and 8-column group of one 32-input block (kernels.c,
    "Block-quantized weights") and the cold call's GB/s of weights."""
    from peagle.model import kernels, quant as q

    q.require_kernels("micro.py quant")
    N, K = args.shape
    rows_max = max(args.rows)
    x, y = torch.randn(rows_max, K).bfloat16(), torch.empty(rows_max, N, dtype=torch.bfloat16)
    paths = args.paths or [args.path or kernels.quant_path()]
    if args.paths and args.path:
        raise SystemExit("micro.py quant: give --path or --paths, not both")
    for p in paths:
        if p not in kernels.quant_paths():
            raise SystemExit(f"micro.py quant: path {p!r} does not run here; this machine runs {kernels.quant_paths()}")
    if args.amx_min_rows and hasattr(kernels.library(), "peagle_qgemm_amx_min_rows"):
        kernels.library().peagle_qgemm_amx_min_rows(args.amx_min_rows)
    header(args, f"{N}x{K}, quantized path{'s' if len(paths) > 1 else ''} {', '.join(paths)}, fastest of "
                 f"{args.repeats} x {args.calls} calls" + (" (the paths taking turns)" if len(paths) > 1 else ""))
    print(f"| format |{' path |' if args.paths else ''} rows | hot us | hot ns per row-block | cold us | cold GB/s | "
          "cold vs first rows |")
    print(f"|---|{'---|' if args.paths else ''}---:|---:|---:|---:|---:|---:|")
    groups_blocks = -(-N // q.QCOLS) * (K // q.BLOCK)
    for fmt in args.formats:
        if fmt in q.QUANTIZATIONS:
            blocks = q.quantize_blocks(torch.randn(N, K), fmt)
        else:  # no quantizer (K-quants, Q5): random bytes, each byte pair a normal fp16 (the cost is the same)
            f = q.FORMATS[fmt]
            blocks = torch.randint(0x10, 0x3C, (N, K // f.inputs * f.block_bytes), dtype=torch.uint8)
        one = q.QuantWeight.from_blocks(blocks, fmt, N, K, path=args.path)
        pool = [q.QuantWeight.from_blocks(blocks, fmt, N, K, path=args.path)  # the same bytes in distinct memory
                for _ in range(max(2, args.pool_mb * 2 ** 20 // one.nbytes))]
        # every path's kernel runs the same qpanels; with --paths they take turns, repeat by repeat
        fns = {p: getattr(kernels.library(), kernels.qgemm_symbol(p, fmt)) for p in paths}
        base = {}
        for rows in args.rows:
            def timed(weights: list) -> dict:
                best = dict.fromkeys(paths, math.inf)
                for _ in range(args.repeats):
                    for p, fn in fns.items():
                        t0 = time.process_time()
                        for i in range(args.calls):
                            w = weights[i % len(weights)]
                            fn(x.data_ptr(), K, w.data_ptr, y.data_ptr(), N, rows, N, K, 1)
                        best[p] = min(best[p], (time.process_time() - t0) / args.calls)
                return best

            hot, cold = timed([one]), timed(pool)
            for p in paths:
                base.setdefault(p, cold[p])
                print(f"| {fmt} |{f' {p} |' if args.paths else ''} {rows} | {hot[p] * 1e6:.1f} | "
                      f"{hot[p] * 1e9 / groups_blocks / rows:.2f} | {cold[p] * 1e6:.1f} | "
                      f"{one.nbytes / cold[p] / 1e9:.1f} | {cold[p] / base[p]:.2f}x |", flush=True)
    footer()


# ---- forward: the target's whole forward per weight format, optionally against transformers

def load_format(name: str, model: str | None, block_path: str | None = None):
    """A weight format by name: bf16 (the model folder), gguf (the embedded model's own Q4_1 file, or --model's GGUF
    file) or a block format quantized at load; block_path: the quantized-weight path its blocks run on (default:
    this machine's)."""
    from peagle.model import kernels
    from peagle.model.loading import embedded_gguf_path, resolve_model
    from peagle.model.target import TargetModel

    default = kernels.quant_path
    if block_path is not None:
        kernels.quant_path = lambda: block_path  # what QuantWeight takes when no path is given
    try:
        if name == "gguf":
            return TargetModel.from_pretrained(embedded_gguf_path() if model is None else resolve_model(model))
        return TargetModel.from_pretrained(resolve_model(model), quantization=None if name == "bf16" else name)
    finally:
        kernels.quant_path = default


def streaming_read_gbs(threads: int, mb: int = 512) -> float:
    """How fast this machine streams memory into the cores: a sum over a buffer far larger than the caches."""
    torch.set_num_threads(threads)
    buf = torch.ones(mb * 2 ** 20 // 4)
    clock = clock_for(threads)
    best = math.inf
    for _ in range(5):
        t0 = clock()
        buf.sum()
        best = min(best, clock() - t0)
    return buf.numel() * 4 / best / 1e9


def hf_step(path: Path, context: int, rows_list: list[int]) -> dict[int, Callable[[], object]]:
    """transformers' forward of the same weights at each row count over a `context`-token cache (cropped back after
    every step, as ours simply overwrites the same positions)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cache = DynamicCache(config=hf.config)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        hf(torch.randint(100, hf.config.vocab_size, (1, context), generator=g), past_key_values=cache, use_cache=True,
           logits_to_keep=1)
    steps = {}
    for rows in rows_list:
        tokens = torch.randint(100, hf.config.vocab_size, (1, rows), generator=g)

        def step(tokens=tokens, rows=rows):
            with torch.inference_mode():
                hf(tokens, past_key_values=cache, use_cache=True, logits_to_keep=0)
            cache.crop(-rows)
        steps[rows] = step
    return steps


def forward(args) -> None:
    """Median ms of one forward of 1 / 4 / 8 / 16 query rows (logits for every row) over a --context cache per
    format, with the weights' read rate (bytes of weights one forward reads over its time, as a share of the
    machine's streaming read) and the cost relative to the first row count; then a --prefill-token prefill."""
    from peagle.model.loading import resolve_model

    from peagle.model import kernels

    if args.amx_min_rows and hasattr(kernels.library(), "peagle_qgemm_amx_min_rows"):
        kernels.library().peagle_qgemm_amx_min_rows(args.amx_min_rows)
    models = {name if bp is None else f"{name} {bp}": load_format(name, args.model, bp)
              for name in args.formats for bp in (args.block_paths or [None])}
    caches = {name: filled_cache(m, 1, args.context, max(args.rows) + 1) for name, m in models.items()}
    stream = streaming_read_gbs(args.threads)
    torch.set_num_threads(args.threads)
    clock = clock_for(args.threads)
    hf = hf_step(resolve_model(args.model), args.context, args.rows) if args.hf else {}
    header(args, f"{args.context}-token context, median of {args.iters}; streaming read {stream:.1f} GB/s")
    table: dict[str, dict[int, float]] = {name: {} for name in [*models, *(["transformers"] if hf else [])]}
    for rows in args.rows:
        fns = {name: decode_rows(m, caches[name], args.context, rows) for name, m in models.items()}
        if hf:
            fns["transformers"] = hf[rows]
        for name, times in interleaved(fns, args.iters, clock, warmup=3).items():
            table[name][rows] = statistics.median(times) * 1e3
    print("| weights | MB | " + " | ".join(f"{r} row{'s' * (r > 1)}: ms (GB/s, of stream, vs first)" for r in args.rows)
          + " |")
    print("|---|---:|" + "---:|" * len(args.rows))
    mb = {name: m.weight_bytes() / 1e6 for name, m in models.items()}
    mb["transformers"] = mb.get("bf16", next(iter(mb.values())))
    for name, row in table.items():
        cells = [f"{row[r]:.1f} ({mb[name] / row[r]:.1f}, {mb[name] / row[r] / stream:.0%}, "
                 f"{row[r] / row[args.rows[0]]:.2f}x)" for r in args.rows]
        print(f"| {name} | {mb[name]:.0f} | " + " | ".join(cells) + " |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        name = args.formats[0]
        step = decode_rows(models[name], caches[name], args.context, args.rows[0])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if args.prefill:
        prefill(models, args.prefill, clock)
    footer()


def prefill(models: dict, n: int, clock: Callable[[], float]) -> None:
    """One forward of an n-token prompt into an empty cache (logits for the last row only, as serving does)."""
    from peagle.model.layers import BatchLayout

    vocab = min(m.config.vocab_size for m in models.values())
    prompt = torch.randint(100, vocab, (1, n), generator=torch.Generator().manual_seed(1))
    layout = BatchLayout.build(torch.tensor([0]), torch.arange(n)[None])

    def run(m):
        with torch.inference_mode():
            m(prompt, layout, m.new_cache(1, n + 1))
    times = interleaved({name: lambda m=m: run(m) for name, m in models.items()}, 2, clock)
    print(f"prefill of {n} tokens, tokens/s: " + ", ".join(f"{name} {n / min(t):.0f}" for name, t in times.items()))


# ---- matmul: what `peagle train --dtype auto` decides between

MATMUL_SHAPES = {  # rows x inner -> outer, at a SmolLM2 head's training step
    "mlp up (4096 x 576 -> 1536)": (4096, 576, 1536, False),
    "mlp down (4096 x 1536 -> 576)": (4096, 1536, 576, False),
    "o_proj (4096 x 576 -> 576)": (4096, 576, 576, False),
    "fusion qkv (4096 x 1152 -> 576)": (4096, 1152, 576, False),
    "lm head (1024 x 576 -> 8192)": (1024, 576, 8192, False),
    "lm head input grad (1024 x 8192 -> 576)": (1024, 8192, 576, False),
    "weight grad (1536 x 4096 -> 576)": (1536, 4096, 576, True),  # the transposed product of the backward pass
}


def matmul(args) -> None:
    """GFLOP/s of PyTorch's fp32 and bf16 matrix products at a head's training shapes, best of --repeats."""
    from peagle.train.trainer import fastest_dtype

    header(args, f"best of {args.repeats}")
    clock, g, results = clock_for(args.threads), torch.Generator().manual_seed(0), {}
    for name, (m, k, n, transposed) in MATMUL_SHAPES.items():
        a = torch.randn(k, m, generator=g).t() if transposed else torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g)
        results[name] = {}
        for dt, t in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a_t, b_t = a.to(t), b.to(t)
            times = interleaved({dt: lambda: a_t @ b_t}, args.repeats, clock)[dt]
            results[name][dt] = round(2 * m * k * n / min(times) / 1e9, 1)
    width = max(map(len, results))
    for name, r in results.items():
        print(f"{name:<{width}}  fp32 {r['fp32']:7.1f}  bf16 {r['bf16']:7.1f} GFLOP/s  bf16/fp32 "
              f"{r['bf16'] / r['fp32']:.2f}")
    choice = fastest_dtype(torch.device("cpu"), 576, 1536)
    print(f"peagle train --dtype auto chooses {choice} here")
    print(json.dumps({"threads": args.threads, "gflops": results, "auto_chooses": choice}))


# ---- verify: how a step should verify windows of different sizes

def verify(args) -> None:
    """Per K: one forward of [B, K + 1] rows (every request pays for the widest window); a window for half the
    requests plus a plain step for the other half (two forwards, the weights read twice); one ragged forward, every
    row its own batch entry ([B/2 (K + 1) + B/2, 1]: no padding, one read); all windows ragged; against a plain
    step for all (docs/engine.md, "Choosing K"). Fastest of --repeats."""
    from peagle.model.layers import BatchLayout
    from peagle.model.loading import resolve_model
    from peagle.model.target import TargetModel

    target = TargetModel.from_pretrained(resolve_model(args.model))
    B, half, ctx = args.batch, args.batch // 2, args.context
    cache = target.new_cache(B, ctx + max(args.windows) + 2)
    clock = clock_for(args.threads)
    header(args, f"batch {B}, context {ctx}, fastest of {args.repeats}")

    def run_on(slots: torch.Tensor, positions: torch.Tensor) -> Callable[[], object]:
        layout, tokens = BatchLayout.build(slots, positions), torch.ones(positions.shape, dtype=torch.long)

        def run():
            with torch.inference_mode():
                target(tokens, layout, cache, num_logits=None)
        return run

    def padded(slots: list[int], rows: int):
        return run_on(torch.tensor(slots), ctx + torch.arange(rows)[None].expand(len(slots), -1))

    def ragged(windows: list[int]):
        slots = torch.tensor([i for i, w in enumerate(windows) for _ in range(w + 1)])
        return run_on(slots, torch.tensor([ctx + j for w in windows for j in range(w + 1)])[:, None])

    def best(fn) -> float:
        return min(interleaved({"x": fn}, args.repeats, clock)["x"]) * 1e3

    plain, results = best(padded(list(range(B)), 1)), []
    for w in args.windows:
        a, rest = padded(list(range(half)), w + 1), padded(list(range(half, B)), 1)
        r = {"window": w, "one_forward_ms": best(padded(list(range(B)), w + 1)),
             "split_ms": best(lambda: (a(), rest())),
             "ragged_ms": best(ragged([w] * half + [0] * (B - half))), "one_forward_flat_ms": best(ragged([w] * B)),
             "plain_ms": plain}
        results.append({k: round(v, 1) for k, v in r.items()})
        print(f"K={w}: one forward [{B}, {w + 1}] {r['one_forward_ms']:.1f} ms (as [{B * (w + 1)}, 1]: "
              f"{r['one_forward_flat_ms']:.1f}); [{half}, {w + 1}] + [{B - half}, 1] {r['split_ms']:.1f} ms; ragged "
              f"[{half * (w + 1) + B - half}, 1] {r['ragged_ms']:.1f} ms; plain [{B}, 1] {plain:.1f} ms", flush=True)
    print(json.dumps(results))


# ---- suffix: what suffix drafts cost

def suffix_corpus(tokenizer) -> list[list[int]]:
    files = sorted((ROOT / "peagle").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    return [tokenizer(f.read_text(encoding="utf-8")).input_ids for f in files]


def suffix_steps(tokens: list[int], context: int, cache, key: str) -> dict[str, float]:
    """A code-editing request whose prompt is a source file and whose answer copies it back, one token a step:
    microseconds (thread CPU) of add_tokens(1 token) and speculate(16 tokens) per step."""
    cache.start_request("edit", tokens[:context], cache_key=key)
    times: dict[str, list[float]] = {"add_token": [], "speculate": []}
    drafted = 0
    for t in tokens[:min(400, context)]:
        t0 = time.thread_time_ns()
        cache.add_tokens("edit", [t])
        t1 = time.thread_time_ns()
        drafted += len(cache.speculate("edit", 16).tokens)
        times["add_token"].append((t1 - t0) / 1e3)
        times["speculate"].append((time.thread_time_ns() - t1) / 1e3)
    cache.abort_request("edit")
    out = {}
    for name, values in times.items():
        values.sort()
        out[f"{name}_mean_us"] = statistics.fmean(values)
        out[f"{name}_p99_us"] = values[int(0.99 * len(values))]
    out["drafted_per_step"] = drafted / len(times["speculate"])
    return out


def suffix_stream(cache, chunks: list[list[int]], requests: int, keys: int, rng: random.Random) -> int:
    """`requests` finished requests through the cache (start, add the output, stop); the peak of its memory
    estimate."""
    peak = 0
    for i in range(requests):
        out = chunks[rng.randrange(len(chunks))]
        cache.start_request(f"r{i}", out[:32], cache_key=f"key{rng.randrange(keys)}")
        cache.add_tokens(f"r{i}", out)
        cache.stop_request(f"r{i}")
        peak = max(peak, cache.memory_bytes())
    return peak


def suffix(args) -> None:
    """Per step on a ~--context-token file of this repository: add_tokens and speculate; then --requests finished
    requests (chunks of 50-400 tokens of the repository's text) under --keys cache keys at the default bounds: the
    peak of the cache's memory estimate, the measured (tracemalloc) size at the end, and the CPU time per request
    at steady state (every stop evicts) over 200 more (docs/design.md, "Suffix drafts")."""
    import tracemalloc

    from peagle.engine.proposers.suffix_tree import SuffixCache
    from peagle.model.loading import load_tokenizer, resolve_model

    docs = suffix_corpus(load_tokenizer(resolve_model(None)))
    source = max(docs, key=len)
    header(args, f"corpus {len(docs)} files, {sum(map(len, docs))} tokens; context file {len(source)} tokens")
    print("own tree only:", fmt(suffix_steps(source, args.context, SuffixCache(), "solo")))
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
    peak = suffix_stream(cache, chunks, args.requests, args.keys, rng)
    measured = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    t0 = time.process_time()
    suffix_stream(cache, chunks, 200, args.keys, rng)
    print("stream:", fmt({"requests": args.requests, "peak_estimate_mb": peak / 2 ** 20,
                          "final_estimate_mb": cache.memory_bytes() / 2 ** 20, "measured_mb": measured / 2 ** 20,
                          "cached_requests": cache.num_cached_requests, "cached_tokens": cache.num_cached_tokens,
                          "cpu_ms_per_request_at_steady_state": (time.process_time() - t0) * 1e3 / 200}))
    print("own + shared tree (key0):", fmt(suffix_steps(source, args.context, cache, "key0")))


def fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


# ---- accuracy: what 4- and 8-bit weights cost

def heldout_sequences(limit: int) -> list[torch.Tensor]:
    """The bundled heads' held-out conversations (SmolLM2's own answers to ShareGPT prompts, never trained on),
    rendered with the chat template."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from head_data import BUNDLED_DATA, bundled_heldout_ids

    from peagle.model.loading import embedded_model_dir, load_tokenizer
    from peagle.train.data import iter_json_records

    ids = bundled_heldout_ids(str(ROOT / BUNDLED_DATA))
    tok = load_tokenizer(embedded_model_dir())
    out = []
    for conv in iter_json_records(ROOT / BUNDLED_DATA):
        if conv["id"] in ids and len(out) < limit:
            enc = tok.apply_chat_template(conv["messages"])
            out.append(torch.tensor(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


@torch.inference_mode()
def score(target, sequences: list[torch.Tensor]) -> tuple[torch.Tensor, float, int]:
    """Argmax per position of every sequence (concatenated), total negative log-likelihood, tokens scored."""
    from peagle.model.layers import BatchLayout

    argmaxes, nll, n = [], 0.0, 0
    for ids in sequences:
        T = len(ids)
        layout = BatchLayout.build(torch.tensor([0]), torch.arange(T)[None])
        logits = target(ids[None], layout, target.new_cache(1, T), num_logits=None).logits[0, :-1]
        nll -= torch.log_softmax(logits.double(), dim=-1).gather(1, ids[1:, None]).sum().item()
        n += T - 1
        argmaxes.append(logits.argmax(-1))
    return torch.cat(argmaxes), nll, n


def accuracy(args) -> None:
    """Perplexity on the held-out text (teacher-forced, every token after the first) and top-1 agreement with the
    first format, per format; --gguf adds other files of the same model (e.g. llama.cpp's `llama-quantize --pure`
    output, whose `llama-perplexity` is the anchor)."""
    from peagle.model.target import TargetModel

    sequences = heldout_sequences(args.limit)
    header(args, f"{len(sequences)} held-out conversations, {sum(len(s) - 1 for s in sequences)} scored tokens")
    loads = {name: (lambda name=name: load_format(name, None)) for name in args.formats}
    loads.update({Path(p).name: (lambda p=p: TargetModel.from_pretrained(Path(p))) for p in args.gguf})
    rows, reference = [], None
    for name, load in loads.items():
        target = load()
        top1, nll, n = score(target, sequences)
        reference = top1 if reference is None else reference
        rows.append({"weights": name, "format": target.weights, "weight_mb": round(target.weight_bytes() / 1e6, 1),
                     "perplexity": round(math.exp(nll / n), 4),
                     "top1_agreement": round((top1 == reference).double().mean().item(), 4)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| weights | format | MB read per token | perplexity | top-1 agreement with {rows[0]['weights']} |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['weights']} | {r['format']} | {r['weight_mb']} | {r['perplexity']:.3f} | "
              f"{r['top1_agreement']:.3f} |")


# ---- memory: the engine's resident memory per weight format

MEMORY_CHILD = r"""
import json, sys
import torch
torch.set_num_threads(1)
import gguf, safetensors.torch  # noqa: F401 - the loaders' code, imported before the baseline as the engine's is
from peagle.engine import LLMEngine, SamplingParams
from peagle.model import kernels
from peagle.model.heads import resolve_head
from peagle.model.loading import config_dir, resolve_model
from peagle.model.tokenizer import Tokenizer

def rss_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

model, head = sys.argv[1], sys.argv[2]
path = resolve_model(None if model == "bf16" else model)
kernels.library()
tokenizers = [Tokenizer.load(config_dir(path))]  # its code and allocator arenas in the baseline
before_tokenizer = rss_mib()
tokenizers.append(Tokenizer.load(config_dir(path)))  # one more copy: what the engine's own holds (its data)
tokenizer = rss_mib() - before_tokenizer
base = rss_mib()
spec = {"model": head, "method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
engine = LLMEngine.from_pretrained(None if model == "bf16" else model, spec if head != "none" else None,
                                   max_num_seqs=1, max_model_len=1024, speculation_policy="fixed")
engine.generate(["Write a haiku about memory."], SamplingParams(max_tokens=16, temperature=0))
caches = [c for c in (engine.target_cache, engine.drafter_cache) if c is not None]
for t in [t for c in caches for t in c.k + c.v]:
    t.add_(0)  # every KV page resident, as once a sequence fills max_model_len
total = rss_mib() - base
files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
files += sorted(resolve_head(head).glob("*.safetensors")) if head != "none" else []
print(json.dumps({"weights": engine.kernels["weights"], "total": total, "tokenizer": tokenizer,
                  "file": sum(f.stat().st_size for f in files) / 2**20,
                  "kv": sum(t.nbytes for c in caches for t in c.k + c.v) / 2**20, "process": rss_mib()}))
"""


def memory(args) -> None:
    """Each configuration loads in a fresh process, answers one request and has its whole KV cache written. The
    model's figure is the growth of the resident set (VmRSS) over a baseline holding the code (torch, the GGUF
    reader, peagle's kernels, the tokenizer's code by loading one first), less the engine's own tokenizer (its
    data: one more copy, measured before the baseline). It is compared with the weight file(s) plus the KV cache of one slot of
    max_model_len 1024 (and, with a head, the head's file and KV cache). "process" is the whole resident set."""
    print("| model | speculation | weights | files MiB | KV MiB | model resident MiB | / (files + KV) | tokenizer MiB "
          "| process MiB |\n|---|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for model in args.models:
        for head in ("none", args.head):
            out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, model, head], capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode:
                raise SystemExit(f"{model} with head {head}: {out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            resident = r["total"] - r["tokenizer"]
            print(f"| {Path(model).name} | {head} | {r['weights']} | {r['file']:.1f} | {r['kv']:.1f} | {resident:.1f} "
                  f"| {resident / (r['file'] + r['kv']):.2f} | {r['tokenizer']:.1f} | {r['process']:.0f} |", flush=True)


# ---- the entry

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def command(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=fn.__doc__)
        p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time, else wall time)")
        p.set_defaults(run=fn)
        return p

    p = command("quant", quant, "the block-quantized matrix kernel alone, hot and cold, per row count")
    p.add_argument("--formats", nargs="+", default=["q4_0", "q4_1", "q8_0"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("N", "K"),
                   help="one matrix (default: SmolLM2's gate or up projection)")
    p.add_argument("--pool-mb", type=int, default=128, help="weights of the cold pool (well above the L3 cache)")
    p.add_argument("--calls", type=int, default=100, help="calls per timing")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--path", default=None, help="a quantized-weight path (peagle.model.kernels.QUANT_PATHS) "
                   "[this machine's default]")
    p.add_argument("--amx-min-rows", type=int, default=None, help="amx-int8: the fewest rows a product runs on tiles "
                   "(fewer run VNNI's kernel) [the library's default]")
    p.add_argument("--paths", nargs="+", default=None, help="several quantized-weight paths measured side by side "
                   "(taking turns in this process, so a busy machine's load falls on all alike)")

    p = command("forward", forward, "the target's forward per weight format (and transformers')")
    p.add_argument("--model", default=None, help="model folder or name (default: the embedded SmolLM2)")
    p.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "gguf", *FORMATS],
                   help="bf16, gguf (the model's own GGUF: the embedded Q4_1 by default), or quantized at load")
    p.add_argument("--hf", action="store_true", help="also transformers' forward of the bf16 weights")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16], help="query rows per forward")
    p.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill (0: skip)")
    p.add_argument("--profile", action="store_true", help="a torch.profiler table of the first format's step")
    p.add_argument("--block-paths", nargs="+", default=None, help="load each format once per quantized-weight path "
                   "(peagle.model.kernels.QUANT_PATHS), measured side by side [this machine's default only]")
    p.add_argument("--amx-min-rows", type=int, default=None, help="amx-int8: the fewest rows a product runs on tiles "
                   "(fewer run VNNI's kernel) [the library's default]")

    p = command("matmul", matmul, "fp32 against bf16 matrix products at a head's training shapes")
    p.add_argument("--repeats", type=int, default=5)

    p = command("verify", verify, "one verify forward against split and ragged windows")
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--windows", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--context", type=int, default=200, help="cached positions each request attends to")
    p.add_argument("--repeats", type=int, default=5)

    p = command("suffix", suffix, "suffix-tree lookups per step and the shared tries' memory")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)

    p = command("accuracy", accuracy, "perplexity and top-1 agreement per weight format")
    p.add_argument("--formats", nargs="+", default=["bf16", "gguf", "q8_0", "q4_0"], choices=["bf16", "gguf", *FORMATS])
    p.add_argument("--limit", type=int, default=32, help="held-out conversations scored (at most 32)")
    p.add_argument("--gguf", nargs="*", default=[], help="more GGUF files of the same model to score")

    p = command("memory", memory, "the engine's resident memory per weight format")
    p.add_argument("--models", nargs="+", default=["bf16", "smollm2-q4_1"], help="bf16 or a model name or path")
    p.add_argument("--head", default="smollm2-135m-peagle", help="the head of the speculative configuration")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    args.run(args)


if __name__ == "__main__":
    main()
