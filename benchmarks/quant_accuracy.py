"""What 4- and 8-bit weights cost in accuracy: perplexity on held-out text and top-1 agreement with the bf16 model,
for the embedded SmolLM2 in every weight format peagle runs.

The text is the bundled heads' 32 held-out conversations (SmolLM2's own answers to ShareGPT prompts, rendered with
its chat template; never trained on), scored teacher-forced over every token after the first. Formats: bf16 (the
embedded target), the embedded model's own Q4_1 GGUF (`smollm2-q4_1`), Q4_0 / Q8_0 quantized at load (the LM head
and embedding in Q8_0, as `--quantization` does) and Q4_0 with a Q4_0 LM head as well; `--gguf`
adds other files (for example llama.cpp's `llama-quantize --pure` output, whose `llama-perplexity` is the anchor).

    python benchmarks/quant_accuracy.py --threads 1
    python benchmarks/quant_accuracy.py --gguf /tmp/smollm2-q4_0.gguf --limit 8
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def heldout_texts(limit: int) -> list[list[dict]]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from split_head_data import BUNDLED_DATA, bundled_heldout_ids

    ids = bundled_heldout_ids(str(ROOT / BUNDLED_DATA))
    convs = [json.loads(line) for line in open(ROOT / BUNDLED_DATA, encoding="utf-8") if line.strip()]
    return [c["messages"] for c in convs if c["id"] in ids][:limit]


@torch.inference_mode()
def score(target, sequences: list[torch.Tensor]) -> tuple[torch.Tensor, float, int]:
    """Argmax per position of every sequence (concatenated), total negative log-likelihood, tokens scored."""
    from peagle.model.layers import BatchLayout

    argmaxes, nll, n = [], 0.0, 0
    for ids in sequences:
        T = len(ids)
        cache = target.new_cache(1, T)
        logits = target(ids[None], BatchLayout.build(torch.tensor([0]), torch.arange(T)[None]), cache,
                        num_logits=None).logits[0, :-1]
        logp = torch.log_softmax(logits.double(), dim=-1)
        nll -= logp.gather(1, ids[1:, None]).sum().item()
        n += T - 1
        argmaxes.append(logits.argmax(-1))
    return torch.cat(argmaxes), nll, n


def q4_0_everywhere(model_dir: Path):
    """The embedded model with its LM head and embedding in Q4_0 as well (what `--quantization` avoids)."""
    from safetensors.torch import load_file

    from peagle.model.target import TargetModel, quantize_state

    raw = json.loads((model_dir / "config.json").read_text())
    state = {k.removeprefix("model."): v for k, v in load_file(model_dir / "model.safetensors").items()}
    state = quantize_state(state, "q4_0", True, embedding_fmt="q4_0")
    return TargetModel._build(raw, state, model_dir, "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=32, help="held-out conversations scored (at most 32)")
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUF files of the same model to score")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the table as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from peagle.model.loading import embedded_gguf_path, embedded_model_dir
    from peagle.model.target import TargetModel

    bf16_dir = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    sequences = []
    for msgs in heldout_texts(args.limit):
        enc = tok.apply_chat_template(msgs)
        sequences.append(torch.tensor(enc["input_ids"] if hasattr(enc, "keys") else enc))
    print(f"{len(sequences)} held-out conversations, {sum(len(s) - 1 for s in sequences)} scored tokens", flush=True)
    models = {"bf16": lambda: TargetModel.from_pretrained(bf16_dir),
              "q4_1 (embedded GGUF)": lambda: TargetModel.from_pretrained(embedded_gguf_path()),
              "q8_0 (at load)": lambda: TargetModel.from_pretrained(bf16_dir, quantization="q8_0"),
              "q4_0 (at load)": lambda: TargetModel.from_pretrained(bf16_dir, quantization="q4_0"),
              "q4_0, LM head too": lambda: q4_0_everywhere(bf16_dir)}
    for path in args.gguf:
        models[Path(path).name] = lambda p=path: TargetModel.from_pretrained(Path(p))
    rows, reference = [], None
    for name, load in models.items():
        t0 = time.time()
        target = load()
        top1, nll, n = score(target, sequences)
        reference = top1 if reference is None else reference
        row = {"weights": name, "format": target.weights, "weight_mb": round(target.weight_bytes() / 1e6, 1),
               "perplexity": round(math.exp(nll / n), 4), "top1_agreement_with_bf16": round(
                   (top1 == reference).double().mean().item(), 4), "seconds": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del target
    print("\n| weights | format | MB read per token | perplexity | top-1 agreement with bf16 |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['weights']} | {r['format']} | {r['weight_mb']} | {r['perplexity']:.3f} | "
              f"{r['top1_agreement_with_bf16']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
