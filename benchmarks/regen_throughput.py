"""Answers a minute of `peagle data prepare --regenerate` at several batch sizes, side by side in one process.

    OMP_NUM_THREADS=1 python3 benchmarks/regen_throughput.py --prompts data/heads/prompts.jsonl.gz --n 16 \
        --batch-sizes 4 16 --max-new-tokens 64

Each batch size answers the same first N prompts (one turn each) with the same generator (the engine on a CPU,
transformers' batched generate() on a GPU: data_cmd.make_generator), after one warm-up batch. Wall time and
process CPU time are both reported: on a shared machine only the CPU figure compares runs.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from itertools import islice
from pathlib import Path

from peagle.train.data import iter_conversations
from peagle.train.data_cmd import make_generator, regen_device, regenerate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="conversations (.jsonl or .jsonl.gz)")
    ap.add_argument("--n", type=int, default=16, help="prompts answered per batch size")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default="auto", choices=("auto", "engine", "transformers"))
    args = ap.parse_args()
    from peagle.model.loading import load_tokenizer, resolve_model

    target = resolve_model(None)
    tok = load_tokenizer(target)
    device = regen_device(args.device)
    convs = [(cid, [m for m in msgs if m["role"] != "assistant"][:1] + [{"role": "assistant", "content": ""}])
             for cid, msgs in islice(iter_conversations(args.prompts), args.n)]
    gen = make_generator(target, tok, max_new_tokens=args.max_new_tokens, backend=args.backend, device=device,
                         max_num_seqs=max(args.batch_sizes))
    gen([convs[0][1][:1]])  # warm-up: kernels, caches
    results = []
    for bs in args.batch_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            w, c = time.time(), time.process_time()
            done = list(regenerate(iter(convs), gen, tok, Path(tmp) / "regenerated.jsonl", bs))
            wall, cpu = time.time() - w, time.process_time() - c
        results.append({"batch_size": bs, "answers": len(done), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                        "answers_per_min_wall": round(60 * len(done) / wall, 1),
                        "answers_per_min_cpu": round(60 * len(done) / cpu, 1),
                        "backend": getattr(gen, "backend", "?"), "device": device})
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
