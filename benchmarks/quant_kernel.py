"""The block-quantized matrix kernel alone, per row of a verify window: what a further row costs in arithmetic
(weights hot in cache) and what a whole step costs when the weights stream from memory (cold), on one thread.

One matrix of the embedded SmolLM2's MLP shape (1,536 x 576, a gate or up projection) per format, called through
the library's own entry point with the arguments prepared once, so Python adds about a microsecond a call. Hot:
the same packed matrix every call (it stays in L2). Cold: a pool of distinct matrices larger than the last-level
cache, one after another, as a forward streams its layers. Figures: microseconds a call (fastest of --repeats),
nanoseconds per row and 8-column group of one 32-input block (the kernel's unit of work, kernels.c "Block-quantized
weights"), and the cold call's GB/s of weights. CPU time.

    python benchmarks/quant_kernel.py
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--shape", type=int, nargs=2, default=[1536, 576], metavar=("N", "K"))
    ap.add_argument("--pool-mb", type=int, default=128, help="weights of the cold pool (well above the L3 cache)")
    ap.add_argument("--calls", type=int, default=100, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from peagle.model import kernels, quant

    quant.require_kernels("this benchmark")
    N, K = args.shape
    x = torch.randn(max(args.rows), K).bfloat16()
    y = torch.empty(max(args.rows), N, dtype=torch.bfloat16)
    print(f"{kernels.describe()}; quantized path {kernels.quant_path()}; {N}x{K}; CPU time, fastest of "
          f"{args.repeats} x {args.calls} calls; load average at start {os.getloadavg()[0]:.2f}")
    print("| format | rows | hot us | hot ns per row-block | cold us | cold GB/s | cold vs 1 row |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    groups_blocks = -(-N // quant.QCOLS) * (K // quant.BLOCK)
    for fmt in args.formats:
        blocks = quant.quantize_blocks(torch.randn(N, K), fmt)
        one = quant.QuantWeight.from_blocks(blocks, fmt, N, K)
        # the same bytes in distinct memory: what streams is what counts
        pool = [quant.QuantWeight.from_blocks(blocks, fmt, N, K)
                for _ in range(max(2, args.pool_mb * 2 ** 20 // one.nbytes))]
        base = None
        for rows in args.rows:
            def timed(weights) -> float:
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.process_time()
                    for i in range(args.calls):
                        w = weights[i % len(weights)]
                        w.gemm(x.data_ptr(), K, w.data_ptr, y.data_ptr(), N, rows, N, K, 1)
                    best = min(best, (time.process_time() - t0) / args.calls)
                return best

            hot, cold = timed([one]), timed(pool)
            base = cold if rows == args.rows[0] else base
            print(f"| {fmt} | {rows} | {hot * 1e6:.1f} | {hot * 1e9 / groups_blocks / rows:.2f} | {cold * 1e6:.1f} | "
                  f"{one.nbytes / cold / 1e9:.1f} | {cold / base:.2f}x |")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
