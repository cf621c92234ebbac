"""The two attention paths side by side: "avx2" (fp32 FMAs for the scores and the weighted values) and "avx512-bf16"
(`vdpbf16ps` for both), alternating in one process, CPU time of one thread, the fastest of --repeats: the
attention kernel alone over a causal prefill of --tokens rows (one layer's shapes of the embedded SmolLM2), and the
target's whole prefill of the same rows (what the campaign's teacher runs for every training row), with how far
the two paths' results are apart on real text (the first --tokens tokens of docs/design.md): the relative
difference of the last hidden states, the share of rows whose greedy next token is the same, and each path's
perplexity of the text.

    python3 benchmarks/attention_paths.py --tokens 4000 512
"""
from __future__ import annotations

import argparse
import time

import torch

from peagle.model import kernels


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4000, 512])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    paths = [p for p in ("avx2", "avx512-bf16") if p == "avx2" or "avx512-bf16" in kernels.supported_paths()]
    if len(paths) < 2:
        raise SystemExit("this CPU runs only the avx2 attention path: nothing to compare")
    from peagle.model.layers import BatchLayout
    from peagle.model.loading import resolve_model
    from peagle.model.target import TargetModel

    # One model per path: a native decoder layer fixes its attention path when it is built.
    chosen = kernels.attention_path
    models = {}
    for p in paths:
        kernels.attention_path = lambda p=p: p
        models[p] = TargetModel.from_pretrained(resolve_model(None), dtype=torch.bfloat16)
    kernels.attention_path = chosen
    cfg = models[paths[0]].config
    from pathlib import Path

    from peagle.model.loading import load_tokenizer

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    corpus = torch.tensor(load_tokenizer(resolve_model(None))(text)["input_ids"])
    if corpus.numel() < max(args.tokens) + 1:
        raise SystemExit(f"--tokens: docs/design.md has only {corpus.numel() - 1} tokens to predict")
    nh, nkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    print(f"{kernels.describe()}; one thread, CPU seconds, fastest of {args.repeats}")
    print("| tokens | attention, one layer: avx2 / avx512-bf16 | target prefill: avx2 / avx512-bf16 | "
          "hidden states: relative difference | same greedy token | perplexity: avx2 / avx512-bf16 |")
    print("|---:|---|---|---:|---:|---|")
    for n in args.tokens:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, n, h, D, generator=g).bfloat16() for h in (nh, nkv, nkv))
        cache = torch.zeros(1, nkv, n, D, dtype=torch.bfloat16), torch.zeros(1, nkv, n, D, dtype=torch.bfloat16)
        slots, positions = torch.zeros(1, dtype=torch.long), torch.arange(n)[None]
        ids = corpus[None, :n]
        layout = BatchLayout.build(slots, positions)
        attn, prefill, hidden = {}, {}, {}
        for p in paths:  # alternating: the first pass warms both
            attn[p] = best(lambda: kernels.attention_bf16(q, k, v, *cache, slots, positions, path=p), args.repeats)

            def forward(p=p):
                with torch.inference_mode():
                    hidden[p] = models[p].trunk(ids, layout, models[p].new_cache(1, n))[0]
            prefill[p] = best(forward, args.repeats)
        a, b = paths
        ha, hb = hidden[a][0].float(), hidden[b][0].float()
        rel = ((ha - hb).norm() / ha.norm()).item()
        same, nll = 0, {a: 0.0, b: 0.0}
        with torch.inference_mode():
            for i in range(0, n, 256):
                la, lb = (models[p].logits(hidden[p][0, i:i + 256]) for p in paths)
                same += int((la.argmax(-1) == lb.argmax(-1)).sum())
                for p, lg in ((a, la), (b, lb)):
                    nll[p] += float(torch.nn.functional.cross_entropy(lg, corpus[i + 1:i + 1 + lg.shape[0]],
                                                                      reduction="sum"))
        print(f"| {n} | {attn[a]:.3f} / {attn[b]:.3f} s ({attn[a] / attn[b]:.2f}x) | "
              f"{prefill[a]:.2f} / {prefill[b]:.2f} s ({prefill[a] / prefill[b]:.2f}x) | {rel:.2e} | "
              f"{same / n:.3f} | {torch.tensor(nll[a] / n).exp():.3f} / {torch.tensor(nll[b] / n).exp():.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
