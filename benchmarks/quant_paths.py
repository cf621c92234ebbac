"""The block-quantized weights' two paths side by side: "avx2" (`vpmaddubsw` + `vpmaddwd`, register blocks of 4
rows) and "avx512-vnni" (`vpdpbusd`, register blocks of 8 rows), on the embedded SmolLM2 quantized at load: the
target's whole forward at 1, 2, 4 and 8 query rows of one request over a --context cache (a decode step and the
verify windows of K = 1, 3 and 7), models alternating in one process, CPU time of one thread, the fastest of
--repeats; with each path's cost relative to its own one-row step (what a verify window costs in plain steps) and
a check that both paths give the same logits bit for bit.

    python3 benchmarks/quant_paths.py --formats q4_0 q8_0
"""
from __future__ import annotations

import argparse
import time

import torch

from peagle.model import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["q4_0", "q8_0"], choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10, help="forwards per timing")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = kernels.quant_paths()
    if len(paths) < 2:
        raise SystemExit(f"this CPU runs only the {paths[0] if paths else 'PyTorch'} path: nothing to compare")
    from peagle.model.layers import BatchLayout
    from peagle.model.loading import resolve_model
    from peagle.model.target import TargetModel

    print(f"{kernels.describe()}; one thread, CPU ms of one forward, fastest of {args.repeats} x {args.iters}")
    chosen = kernels.quant_path
    for fmt in args.formats:
        models = {}
        for p in paths:  # one model per path: a native decoder layer fixes its kernels when it is built
            kernels.quant_path = lambda p=p: p
            models[p] = TargetModel.from_pretrained(resolve_model(None), quantization=fmt)
        kernels.quant_path = chosen
        caches = {p: m.new_cache(1, args.context + max(args.rows)) for p, m in models.items()}
        torch.manual_seed(0)
        prompt = torch.randint(100, 40000, (1, args.context))
        with torch.inference_mode():
            for p, m in models.items():  # fill each cache with the same context
                m(prompt, BatchLayout.build(torch.tensor([0]), torch.arange(args.context)[None]), caches[p])
        times = {p: {} for p in paths}
        for T in args.rows:
            tokens = torch.randint(100, 40000, (1, T))
            layout = BatchLayout.build(torch.tensor([0]), args.context + torch.arange(T)[None])
            logits = {}

            def forward(p):
                return models[p](tokens, layout, caches[p], num_logits=None).logits

            with torch.inference_mode():
                for p in paths:
                    logits[p] = forward(p)
                for _ in range(args.repeats):
                    for p in paths:  # alternating, so load from other processes hits both alike
                        t = time.thread_time()
                        for _ in range(args.iters):
                            forward(p)
                        ms = (time.thread_time() - t) / args.iters * 1000
                        times[p][T] = min(times[p].get(T, ms), ms)
            if not torch.equal(logits[paths[0]], logits[paths[1]]):
                raise SystemExit(f"{fmt}, {T} rows: the paths' logits differ; they must be the same bits")
        print(f"\n{fmt}, {args.context}-token context (logits of every row; the same bits on both paths)")
        print("| rows | " + " | ".join(f"{p} ms (x 1 row)" for p in paths) + f" | {paths[0]} speed-up |")
        print("|---:|" + "---:|" * (len(paths) + 1))
        for T in args.rows:
            cells = [f"{times[p][T]:.2f} ({times[p][T] / times[p][args.rows[0]]:.2f}x)" for p in paths]
            print(f"| {T} | " + " | ".join(cells) + f" | {times[paths[1]][T] / times[paths[0]][T]:.2f}x |")


if __name__ == "__main__":
    main()
