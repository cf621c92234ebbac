"""peagle next to llama.cpp on the same machine, weights and thread count, in one run.

llama.cpp's `llama-bench` measures decode from an empty context (tg64), decode at deeper contexts (tg64 at depth
512 and 4096) and a 512-token prefill (pp512) on a GGUF of the embedded SmolLM2; peagle's engine does the same on
the same file (plain decoding, no speculation: this compares the forward). A Q4_0 / Q4_1 / Q8_0 file runs from its
own blocks in both; a bf16 file runs on peagle's bf16 target (the same weights). Rounds alternate between the two,
so load from other processes on a shared machine hits both alike; each figure is the median over rounds, wall time.

Nothing here builds or downloads llama.cpp: build `llama-bench` from its source (for example the copy inside the
llama-cpp-python source package), convert the weights with its `convert_hf_to_gguf.py --outtype bf16` and quantize
them with `llama-quantize --pure` (or use the embedded model's own Q4_1 file: `--gguf smollm2-q4_1`):

    python benchmarks/vs_llama_cpp.py --llama-bench /path/to/llama-bench --gguf smollm2-q4_0.gguf --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

import torch


def llama_bench(binary: str, gguf: str, threads: int, args: list[str]) -> float:
    """Tokens per second of one llama-bench test (one repetition)."""
    out = subprocess.run([binary, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", *args],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--gguf", required=True,
                    help="a GGUF of the embedded SmolLM2 (bf16, Q4_0, Q4_1 or Q8_0; smollm2-q4_1: its own file)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", type=int, nargs="+", default=[512, 4096], help="contexts to decode at")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from peagle.engine import LLMEngine, SamplingParams
    from peagle.model import kernels
    from peagle.model.loading import resolve_model

    gguf = resolve_model(args.gguf)
    float_file = "bf16" in gguf.name.lower() or "f16" in gguf.name.lower()
    # Every round sends the same prompts: with the prefix cache on, pp512 would time a cache hit, not a prefill.
    engine = LLMEngine.from_pretrained(None if float_file else str(gguf), None, max_num_seqs=1,
                                       max_model_len=max(args.depths) + 128, device="cpu",
                                       enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = {d: torch.randint(100, 40000, (d,), generator=g).tolist() for d in args.depths}

    def ours() -> dict:
        params = SamplingParams(max_tokens=65, ignore_eos=True, temperature=0.0)
        short = engine.generate([[1]], params)[0]  # decode from (almost) an empty context
        out = {"tg64": 64 / (short.elapsed - short.time_to_first_token)}
        for d, prompt in prompts.items():  # a d-token prefill, then decode at depth d
            deep = engine.generate([prompt], params)[0]
            out[f"tg64@d{d}"] = 64 / (deep.elapsed - deep.time_to_first_token)
            if d == 512:
                out["pp512"] = 512 / deep.time_to_first_token
        return out

    def theirs() -> dict:
        b = lambda *a: llama_bench(args.llama_bench, str(gguf), args.threads, list(a))  # noqa: E731
        out = {"tg64": b("-p", "0", "-n", "64")}
        for d in args.depths:
            out[f"tg64@d{d}"] = b("-p", "0", "-n", "64", "-d", str(d))
        if 512 in args.depths:
            out["pp512"] = b("-p", "512", "-n", "0")
        return out

    ours()  # warm-up
    runs = {"peagle": [], "llama.cpp": []}
    for i in range(args.rounds):
        order = [("peagle", ours), ("llama.cpp", theirs)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(fn())
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()),
                  flush=True)
    print(f"\n{gguf.name}: peagle runs {engine.target.weights} weights; {kernels.describe()}; {args.threads} "
          f"thread(s); load average {os.getloadavg()[0]:.2f}")
    print(f"{'test':<11} {'peagle tok/s':>13} {'llama.cpp tok/s':>16} {'ratio':>7}")
    for test in runs["peagle"][0]:
        a = statistics.median(r[test] for r in runs["peagle"])
        b = statistics.median(r[test] for r in runs["llama.cpp"])
        print(f"{test:<11} {a:>13.1f} {b:>16.1f} {a / b:>6.2f}x")


if __name__ == "__main__":
    main()
