"""Training throughput per core: tokens per CPU-second of P-EAGLE (or EAGLE-3) training steps on the embedded
SmolLM2, with the bundled heads' recipe and data, the teacher's outputs read from a warm cache.

    OMP_NUM_THREADS=1 python benchmarks/train_throughput.py --steps 6 --repeats 2

The first pass over `--steps` optimizer steps (4 conversations each) fills a teacher cache and times the target's
forward on its own; each repeat then runs the same steps again (the same batches, from the cache) and reports
tokens per CPU-second of the process (time.process_time, so other jobs on a shared machine inflate it less than
they inflate wall time) and per wall-second. Runs against any checkout: `PYTHONPATH=/path/to/other/checkout python
benchmarks/train_throughput.py` measures that version with the same command (one that predates reading
gzip-compressed conversations needs an unpacked copy of the default data: `gzip -dc
data/heads/smollm2-regenerated.jsonl.gz > /tmp/regenerated.jsonl` and `--data /tmp/regenerated.jsonl`).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/heads/smollm2-regenerated.jsonl.gz")
    p.add_argument("--method", choices=("peagle", "eagle3"), default="peagle")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default=None, help="the head's compute dtype (peagle train --dtype) [its default]")
    p.add_argument("--num-depths", type=int, default=None, help="COD depths / TTT steps [the bundled head's]")
    p.add_argument("--cod-ratio", type=float, default=None, help="COD retention r [peagle train's default]")
    p.add_argument("--freeze-lm-head", action="store_true", help="keep the LM head at the target's rows")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's top operators of one step")
    args = p.parse_args(argv)
    import torch

    import peagle
    from peagle.train.trainer import TrainConfig, Trainer

    torch.set_num_threads(args.threads)
    recipe = dict(num_layers=2, num_depths=12) if args.method == "peagle" else dict(num_layers=1, num_depths=7)
    if args.dtype:
        recipe.update(dtype=args.dtype, target_dtype="bf16")
    if args.num_depths:
        recipe.update(num_depths=args.num_depths)
    if args.cod_ratio:
        recipe.update(cod_ratio=args.cod_ratio)
    if args.freeze_lm_head:
        recipe.update(freeze_lm_head=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(data=args.data, out=f"{tmp}/out", method=args.method, draft_vocab_size=8192, batch_size=4,
                          lr=1e-3, max_steps=1000, teacher_cache=f"{tmp}/cache", eval_fraction=0.0, save_every=0,
                          progress=False, **recipe)
        tr = Trainer(cfg)
        teacher_s = teacher_tokens = 0
        for _ in range(args.steps):
            m = tr.train_step()
            teacher_s += m["teacher_seconds"]
            teacher_tokens += m["tokens"]
        passes = []
        for _ in range(args.repeats):
            tr.step = 0
            tokens, cpu0, wall0 = 0, time.process_time(), time.time()
            for _ in range(args.steps):
                tokens += tr.train_step()["tokens"]
            passes.append((tokens, time.process_time() - cpu0, time.time() - wall0))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            tr.step = 0
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                tr.train_step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    tokens = sum(t for t, _, _ in passes)
    cpu, wall = sum(c for _, c, _ in passes), sum(w for _, _, w in passes)
    # getattr: the same script measures older checkouts (PYTHONPATH), whose config may lack a field
    used = {k: getattr(cfg, k, None) for k in ("num_layers", "num_depths", "cod_ratio", "freeze_lm_head")}
    result = {"code": peagle.__file__, "method": args.method, **used,
              "dtype": getattr(tr, "compute_dtype", cfg.dtype), "steps": args.steps, "repeats": args.repeats,
              "threads": args.threads, "tokens": tokens, "tokens_per_cpu_s": round(tokens / cpu, 1),
              "tokens_per_wall_s": round(tokens / wall, 1),
              "teacher_tokens_per_s": round(teacher_tokens / max(teacher_s, 1e-9), 1),
              "per_pass_tokens_per_cpu_s": [round(t / c, 1) for t, c, _ in passes]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
