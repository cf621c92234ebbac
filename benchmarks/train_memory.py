"""Training throughput and peak memory of P-EAGLE on the embedded SmolLM2, by sequence length and partitions.

    python benchmarks/train_memory.py --lengths 2048 8192 --partitions 1 4 16 --steps 2

Each (length, partitions) runs in its own process (peak RSS is per process): it builds the trainer on one sequence
of exactly `length` tokens (real ShareGPT conversations rendered with SmolLM2's chat template and concatenated, so
about the usual share of tokens is supervised), runs `--steps` optimizer steps of one sequence each and reports the
last step: wall time, tokens/s, the part spent in the target (teacher) forward, the COD elements, and peak memory
(the process's max RSS on CPU, torch's max allocated on GPU). Results print as a table and go to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_sequence(length: int, out: Path) -> dict:
    from transformers import AutoTokenizer

    from peagle.model.loading import embedded_model_dir
    from peagle.train.data import build_rows, iter_conversations, save_rows

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    ids, mask = [], []
    for row in build_rows(iter_conversations("sharegpt"), tok):
        ids += row["input_ids"]
        mask += row["loss_mask"]
        if len(ids) >= length:
            break
    ids, mask = ids[:length], mask[:length]
    save_rows([{"id": "bench", "input_ids": ids, "loss_mask": mask}], out, {"source": "sharegpt (concatenated)"})
    return {"tokens": len(ids), "supervised": sum(mask)}


def run_one(args) -> dict:
    import resource

    import torch

    from peagle.train.cod import partition
    from peagle.train.trainer import TrainConfig, Trainer

    S = args.partitions[0]
    cfg = TrainConfig(data=args.data, out=args.work, method=args.method, num_depths=args.num_depths,
                      max_seq_len=args.length, partitions=S, batch_size=1, max_steps=args.steps,
                      eval_fraction=0.0, save_every=0, progress=False, dtype=args.dtype, device=args.device,
                      draft_vocab_size=args.draft_vocab_size)
    tr = Trainer(cfg)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    if tr.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    m = None
    for _ in range(args.steps):
        m = tr.train_step()
    ids, mask = tr._row(tr.train_rows, tr.train_ids[0])
    el = tr._elements(mask, 0, tr.train_ids[0])
    segs = partition(el, ids.numel(), S) if args.method == "peagle" else []
    return {"length": args.length, "partitions": S, "method": args.method, "dtype": args.dtype,
            "device": str(tr.device), "threads": torch.get_num_threads(), "step_seconds": round(m["seconds"], 2),
            "teacher_seconds": round(m["teacher_seconds"], 2), "tokens_per_s": round(m["tokens_per_s"], 1),
            "elements": len(el), "supervised_elements": el.num_supervised,
            "max_segment_rows": max((s.rows.numel() for s in segs), default=len(el)),
            "peak_mem_gib": round(m["peak_mem_gib"], 2), "rss_after_setup_gib": round(base, 2),
            "loss": round(m["loss"], 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--partitions", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--method", default="peagle")
    p.add_argument("--num-depths", type=int, default=8)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="append results (JSON lines) here")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per configuration")
    # internal: one configuration in this process
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            data = Path(tmp) / f"data-{length}"
            info = build_sequence(length, data)
            print(f"# {length} tokens ({info['supervised']} supervised)", file=sys.stderr, flush=True)
            for S in args.partitions:
                cmd = [sys.executable, __file__, "--one", "--length", str(length), "--partitions", str(S),
                       "--data", str(data), "--work", str(Path(tmp) / f"run-{length}-{S}"), "--method", args.method,
                       "--num-depths", str(args.num_depths), "--steps", str(args.steps), "--dtype", args.dtype,
                       "--device", args.device, "--draft-vocab-size", str(args.draft_vocab_size)]
                t0 = time.time()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                          env={**os.environ, "TQDM_DISABLE": "1"})
                except subprocess.TimeoutExpired:
                    print(f"# {length} tokens, S={S}: over {args.timeout} s, skipped", file=sys.stderr)
                    continue
                res = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
                           None)
                if res is None:
                    print(f"# {length} tokens, S={S}: failed (exit {proc.returncode}): {proc.stderr[-1500:]}",
                          file=sys.stderr)
                    continue
                res["wall_seconds_total"] = round(time.time() - t0, 1)
                extra = [] if args.method == "peagle" else ["--method", args.method]
                extra += [] if args.num_depths == 8 else ["--num-depths", str(args.num_depths)]
                res["command"] = " ".join(["python", "benchmarks/train_memory.py", "--lengths", str(length),
                                           "--partitions", str(S), "--steps", str(args.steps)] + extra)
                rows.append(res)
                print(json.dumps(res), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(res) + "\n")
    print("\n| tokens | partitions | elements | max rows/segment | step s | target s | tokens/s | peak RSS GiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['length']} | {r['partitions']} | {r['elements']} | {r['max_segment_rows']} | {r['step_seconds']} |"
              f" {r['teacher_seconds']} | {r['tokens_per_s']} | {r['peak_mem_gib']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
