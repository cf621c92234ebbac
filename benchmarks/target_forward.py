"""Target forward speed: peagle's TargetModel next to transformers' forward of the same weights, and next to what
the machine's memory allows.

For SmolLM2-135M-Instruct (the embedded default) in bf16, batch 1: the machine's streaming read bandwidth (one and
two threads); one forward of T = 1, 4, 8, 16, 32 query rows over a 512-token cache (logits for every row, as
verification needs) with its weight-read rate (bytes of weights / step time) and its share of the streaming
bandwidth; and a 512-token prefill (tokens/s). Both models see the same cache length every step (transformers'
cache is cropped back after each step, ours simply overwrites the same positions).

    python benchmarks/target_forward.py --threads 1          # the numbers in docs/performance.md
    python benchmarks/target_forward.py --rows 1 --profile   # a torch.profiler table of our 1-row step
    PEAGLE_CPU_KERNELS=avx2 python benchmarks/target_forward.py --threads 1   # another matrix path
    python benchmarks/target_forward.py --threads 1 --model smollm2-q4_1      # the embedded model's own GGUF
    python benchmarks/target_forward.py --threads 1 --quantization q4_0       # quantized at load
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def clock() -> float:
    """CPU time of this process when torch runs one thread: on a shared machine it does not count the time other
    processes hold the core (they still share its caches and memory bandwidth). Wall time with more threads."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def median_ms(fns: dict, iters: int, warmup: int) -> dict:
    """Median ms per call of each function, calls interleaved (a, b, b, a, ...) so that load from other processes
    on a shared machine hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    order = list(fns)
    for i in range(iters):
        for name in (order if i % 2 == 0 else order[::-1]):
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="query rows per step")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill row (0: skip)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quantization", choices=["q4_0", "q4_1", "q8_0"], default=None,
                    help="quantize the matrices at load (a .gguf --model runs its own blocks; both imply --no-hf)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of our step")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from peagle.model.layers import BatchLayout
    from peagle.model.loading import resolve_model
    from peagle.model.target import TargetModel

    path = resolve_model(args.model)
    ours = TargetModel.from_pretrained(path, dtype=dtype, quantization=args.quantization)
    weight_bytes = ours.weight_bytes()
    args.no_hf = args.no_hf or ours.quantized
    B, L = args.batch, args.context
    max_len = L + max(args.rows) + 1
    g = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompt = torch.randint(100, vocab, (B, L), generator=g)
    slots = torch.arange(B)

    cache = ours.new_cache(B, max_len)
    ours(prompt, BatchLayout.build(slots, torch.arange(L)[None].expand(B, L)), cache, num_logits=1)

    hf = hf_cache = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, DynamicCache

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        hf_cache = DynamicCache(config=hf.config)
        with torch.inference_mode():
            hf(prompt, past_key_values=hf_cache, use_cache=True, logits_to_keep=1)

    from peagle.model import kernels

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    threads = torch.get_num_threads()
    stream = {n: streaming_read_gbs(n) for n in (1, 2)}
    torch.set_num_threads(threads)
    print(f"model {path.name} {ours.weights}, batch {B}, context {L}, threads {threads}, "
          f"weights {weight_bytes / 1e6:.0f} MB, median of {args.iters} "
          f"({'CPU' if threads == 1 else 'wall'} time)")
    print(f"cpu {cpu}; {kernels.describe()}; load average at start {os.getloadavg()[0]:.2f}")
    print(f"streaming read: {stream[1]:.1f} GB/s on one thread, {stream[2]:.1f} GB/s on two")
    print(f"{'rows':>5} {'peagle ms':>10} {'GB/s':>6} {'of stream':>10} {'vs 1 row':>9} {'transformers ms':>16} "
          f"{'GB/s':>6} {'speed-up':>9}")
    first = None
    for T in args.rows:
        tokens = torch.randint(100, vocab, (B, T), generator=g)
        positions = (L + torch.arange(T))[None].expand(B, T)

        def step_ours():
            layout = BatchLayout.build(slots, positions)
            return ours(tokens, layout, cache, num_logits=None)

        fns = {"ours": step_ours}
        if hf is not None:
            def step_hf():
                with torch.inference_mode():
                    out = hf(tokens, past_key_values=hf_cache, use_cache=True, logits_to_keep=0)
                hf_cache.crop(-T)
                return out

            fns["hf"] = step_hf
        ms = median_ms(fns, args.iters, args.warmup)
        first = first or ms["ours"]
        gbs = weight_bytes / ms["ours"] / 1e6
        share = gbs / stream[min(threads, 2)]
        line = f"{T:>5} {ms['ours']:>10.1f} {gbs:>6.1f} {share:>9.0%} {ms['ours'] / first:>8.2f}x"
        if hf is not None:
            line += f" {ms['hf']:>16.1f} {weight_bytes / ms['hf'] / 1e6:>6.1f} {ms['hf'] / ms['ours']:>8.2f}x"
        print(line, flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    step_ours()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    one_row_breakdown(ours, cache, slots, L, vocab, args.iters)
    if args.prefill:
        prefill(ours, hf, args.prefill, vocab, max(3, args.iters // 10))


def one_row_breakdown(ours, cache, slots, L: int, vocab: int, iters: int) -> None:
    """Where a one-row decode step's time goes: inside peagle's native calls (each decoder layer is one call, plus
    the LM head's matmul) and everything else (the Python loop, embedding, RoPE tables, logits to fp32, feature
    concatenation, allocation). The native calls are wrapped with a timer for this measurement only."""
    from peagle.model import kernels
    from peagle.model.layers import BatchLayout

    spent = [0.0]

    def timed(fn):
        def call(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += clock() - t0
        return call

    tokens, positions = torch.tensor([[500]] * len(slots)), torch.full((len(slots), 1), L)
    step = lambda: ours(tokens, BatchLayout.build(slots, positions), cache, num_logits=None)  # noqa: E731
    step()
    layer_call, linear = kernels.NativeDecoderLayer.__call__, kernels.packed_linear
    kernels.NativeDecoderLayer.__call__, kernels.packed_linear = timed(layer_call), timed(linear)
    try:
        total = []
        for _ in range(iters):
            t0 = clock()
            step()
            total.append(clock() - t0)
    finally:
        kernels.NativeDecoderLayer.__call__, kernels.packed_linear = layer_call, linear
    step_ms, native_ms = sum(total) / iters * 1e3, spent[0] / iters * 1e3
    print(f"1-row step, mean of {iters}: {step_ms:.1f} ms = native kernels {native_ms:.1f} ms + everything else "
          f"{step_ms - native_ms:.2f} ms")


def streaming_read_gbs(threads: int, mb: int = 512) -> float:
    """How fast this machine streams memory into the cores: a sum over a buffer far larger than the caches."""
    torch.set_num_threads(threads)
    buf = torch.ones(mb * 2 ** 20 // 4)
    buf.sum()
    best = float("inf")
    for _ in range(5):  # the fastest pass: the one least disturbed by other processes
        t0 = clock()
        buf.sum()
        best = min(best, clock() - t0)
    return buf.numel() * 4 / best / 1e9


def prefill(ours, hf, n: int, vocab: int, iters: int) -> None:
    """One forward of an n-token prompt into an empty cache (logits for the last row only, as serving does)."""
    from peagle.model.layers import BatchLayout

    prompt = torch.randint(100, vocab, (1, n), generator=torch.Generator().manual_seed(1))
    cache = ours.new_cache(1, n + 1)
    fns = {"ours": lambda: ours(prompt, BatchLayout.build(torch.tensor([0]), torch.arange(n)[None]), cache)}
    if hf is not None:
        def step_hf():
            with torch.inference_mode():
                return hf(prompt, use_cache=True, logits_to_keep=1)

        fns["hf"] = step_hf
    ms = median_ms(fns, iters, 1)
    line = f"prefill {n} tokens: peagle {ms['ours']:.0f} ms ({n / ms['ours'] * 1e3:.0f} tok/s)"
    if hf is not None:
        line += f", transformers {ms['hf']:.0f} ms ({n / ms['hf'] * 1e3:.0f} tok/s), {ms['hf'] / ms['ours']:.2f}x"
    print(line, flush=True)


def _done():
    print(f"load average at end {os.getloadavg()[0]:.2f} (other processes on the machine share its cores and "
          "memory bandwidth; compare columns within a run)")


if __name__ == "__main__":
    main()
    _done()
