"""The engine on an accelerator (CUDA), with small random models and no network: what scripts/device_check.sh runs.

1. Greedy speculation against plain greedy decoding, for both methods, K in {1, 3, 7} and batches of 1-8 prompts.
   On a GPU PyTorch's kernels run, and they are not batch invariant (a matmul of K+1 rows may round a row
   differently from a matmul of one), so greedy equality is not promised there (docs/performance.md): in fp32 a
   difference needs a near-tie, so nearly every sequence matches; in bf16 more may drift. The check reports the
   share of sequences that match token for token, and fails only if the engine errors or fp32 matches < 90%.
2. Sampling with speculation runs (temperature 1, top-p 0.9) and returns the requested token counts.
3. A short decode benchmark: plain vs speculative tokens/s at batch 1 and 8.

    python scripts/device_check.py --device cuda      # on the GPU machine
    python scripts/device_check.py --device cpu       # the same checks on this machine's CPU
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def tiny_target(out: Path, layers: int, hidden: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=2048, hidden_size=hidden, intermediate_size=4 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                  num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=2048,
                                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


def engine_for(path: Path, method: str | None, k: int, device: str, dtype: torch.dtype, batch: int):
    from peagle.config import SpeculativeConfig
    from peagle.engine import LLMEngine
    from peagle.model.checkpoint import random_head
    from peagle.model.target import TargetModel

    target = TargetModel.from_pretrained(path, dtype=dtype, device=device)
    if method is None:
        return LLMEngine(target, max_num_seqs=batch, max_model_len=512)
    head = random_head(target.config, target.embed_tokens.weight, method, mask_token_id=3, dtype=dtype).to(device)
    spec = SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": k,
                                       "parallel_drafting": method == "peagle", "model": "random"})
    return LLMEngine(target, drafter=head, speculative_config=spec, max_num_seqs=batch, max_model_len=512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from peagle.engine import SamplingParams

    report = {"device": args.device, "name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "lossless": [], "bench": []}
    print(f"device {report['name']}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        small = tiny_target(Path(tmp) / "small", layers=4, hidden=256)
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(4, 40, (8,), generator=g).tolist()
        prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]
        greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
        for dtype in (torch.float32, torch.bfloat16):
            plain = engine_for(small, None, 0, args.device, dtype, 8).generate(prompts, greedy)
            for method in ("peagle", "eagle3"):
                for k in (1, 3, 7):
                    for batch in (1, 8):
                        eng = engine_for(small, method, k, args.device, dtype, batch)
                        outs = eng.generate(prompts, greedy)
                        same = sum(o.token_ids == p.token_ids for o, p in zip(outs, plain))
                        row = {"dtype": str(dtype).removeprefix("torch."), "method": method, "k": k, "batch": batch,
                               "sequences_equal": f"{same}/{len(prompts)}"}
                        report["lossless"].append(row)
                        print(json.dumps(row), flush=True)
                        if dtype == torch.float32 and same < 0.9 * len(prompts):
                            raise SystemExit(f"fp32 greedy speculation matched plain decoding on only {same} of "
                                             f"{len(prompts)} sequences: {row}")
            sampled = engine_for(small, "peagle", 3, args.device, dtype, 8).generate(
                prompts, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=0, ignore_eos=True))
            assert all(len(o.token_ids) == 16 for o in sampled), "sampling returned the wrong token counts"

        big = tiny_target(Path(tmp) / "big", layers=8, hidden=1024)
        for batch in (1, 8):
            for method, k in ((None, 0), ("peagle", 3), ("peagle", 7), ("eagle3", 3)):
                eng = engine_for(big, method, k, args.device, torch.bfloat16, batch)
                eng.generate(prompts[:batch], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                outs = eng.generate(prompts[:batch], SamplingParams(max_tokens=64, ignore_eos=True))
                if args.device == "cuda":
                    torch.cuda.synchronize()
                row = {"batch": batch, "method": method or "none", "k": k,
                       "tokens_per_s": round(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t), 1)}
                report["bench"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
