"""GFLOP/s of PyTorch's matrix products in fp32 and bf16 on this CPU, at the shapes of a SmolLM2 head's training
step: what `peagle train --dtype auto` decides between (docs/training.md).

    python benchmarks/matmul_dtypes.py --threads 1

Rows x inner x outer for the layers' projections (hidden 576, MLP 1536, fusion input 1152), the 8,192-row LM head
forward and its input gradient, and a weight gradient (the transposed product of the backward pass). CPU time per
product, best of `--repeats`.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {
    "mlp up (4096 x 576 -> 1536)": (4096, 576, 1536),
    "mlp down (4096 x 1536 -> 576)": (4096, 1536, 576),
    "o_proj (4096 x 576 -> 576)": (4096, 576, 576),
    "fusion qkv (4096 x 1152 -> 576)": (4096, 1152, 576),
    "lm head (1024 x 576 -> 8192)": (1024, 576, 8192),
    "lm head input grad (1024 x 8192 -> 576)": (1024, 8192, 576),
}


def gflops(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        a @ b
        best = min(best, time.process_time() - t0)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    results = {}
    for name, (m, k, n) in SHAPES.items():
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        results[name] = {dt: round(gflops(a.to(t), b.to(t), args.repeats), 1)
                         for dt, t in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    a, b = torch.randn(4096, 1536, generator=g), torch.randn(4096, 576, generator=g)
    results["weight grad (1536 x 4096 -> 576)"] = {
        dt: round(gflops(a.to(t).t(), b.to(t), args.repeats), 1) for dt, t in (("fp32", torch.float32),
                                                                              ("bf16", torch.bfloat16))}
    width = max(map(len, results))
    for name, r in results.items():
        print(f"{name:<{width}}  fp32 {r['fp32']:7.1f}  bf16 {r['bf16']:7.1f} GFLOP/s  bf16/fp32 "
              f"{r['bf16'] / r['fp32']:.2f}")
    from peagle.train.trainer import fastest_dtype

    choice = fastest_dtype(torch.device("cpu"), 576, 1536)
    print(f"peagle train --dtype auto chooses {choice} here")
    print(json.dumps({"threads": args.threads, "gflops": results, "auto_chooses": choice}))


if __name__ == "__main__":
    main()
