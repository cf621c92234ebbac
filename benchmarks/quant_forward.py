"""The target's forward in every weight format, side by side: bf16, the embedded model's own Q4_1 GGUF, and Q4_0 /
Q8_0 quantized at load, at 1 / 4 / 8 / 16 query rows over a 512-token cache (logits for every row, as
verification needs), and a 512-token prefill.

Calls alternate between the formats (a, b, c, d, d, c, b, a, ...) so that load from other processes on a shared
machine hits all of them alike; one thread, CPU time, median over iterations. GB/s is the bytes of weights one
forward reads (`TargetModel.weight_bytes`) over its time.

    python benchmarks/quant_forward.py --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter

    from peagle.model import kernels
    from peagle.model.layers import BatchLayout
    from peagle.model.loading import embedded_gguf_path, embedded_model_dir
    from peagle.model.target import TargetModel

    bf16 = embedded_model_dir()
    models = {"bf16": TargetModel.from_pretrained(bf16), "q4_1 (GGUF)": TargetModel.from_pretrained(embedded_gguf_path()),
              "q4_0": TargetModel.from_pretrained(bf16, quantization="q4_0"),
              "q8_0": TargetModel.from_pretrained(bf16, quantization="q8_0")}
    L, g = args.context, torch.Generator().manual_seed(0)
    caches = {}
    for name, m in models.items():
        caches[name] = m.new_cache(1, L + max(args.rows) + 1)
        m(torch.randint(100, 40000, (1, L), generator=g), BatchLayout.build(torch.tensor([0]), torch.arange(L)[None]),
          caches[name])
    print(f"{kernels.describe()}; {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, median of "
          f"{args.iters}; load average at start {os.getloadavg()[0]:.2f}")
    print("| format | weights MB | " + " | ".join(f"{r} row{'s' if r > 1 else ''} ms (GB/s, vs 1 row)"
                                               for r in args.rows) + " |")
    print("|---|---:|" + "---:|" * len(args.rows))
    table = {name: {} for name in models}
    for rows in args.rows:
        tokens = torch.randint(100, 40000, (1, rows), generator=g)
        layout = BatchLayout.build(torch.tensor([0]), torch.arange(L, L + rows)[None])
        times = {name: [] for name in models}
        order = list(models)
        for i in range(args.iters + 3):
            for name in order if i % 2 == 0 else order[::-1]:
                t0 = clock()
                models[name](tokens, layout, caches[name], num_logits=None)
                if i >= 3:
                    times[name].append(clock() - t0)
        for name in models:
            table[name][rows] = statistics.median(times[name]) * 1e3
    for name, m in models.items():
        mb = m.weight_bytes() / 1e6
        cells = [f"{table[name][r]:.1f} ({mb / table[name][r]:.1f}, {table[name][r] / table[name][args.rows[0]]:.2f}x)"
                 for r in args.rows]
        print(f"| {name} ({m.weights}) | {mb:.0f} | " + " | ".join(cells) + " |")
    if args.prefill:
        n = args.prefill
        prompt = torch.randint(100, 40000, (1, n), generator=g)
        layout = BatchLayout.build(torch.tensor([0]), torch.arange(n)[None])
        line = []
        for name, m in models.items():
            ts = []
            for _ in range(2):
                cache = m.new_cache(1, n + 1)
                t0 = clock()
                m(prompt, layout, cache)
                ts.append(clock() - t0)
            line.append(f"{name} {n / min(ts):.0f}")
        print(f"\nprefill of {n} tokens, tokens/s: " + ", ".join(line))
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
