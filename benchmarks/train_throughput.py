"""Training throughput per core: tokens per CPU-second of P-EAGLE (or EAGLE-3) training steps on the embedded
SmolLM2, with the bundled heads' recipe and data, the teacher's outputs read from a warm cache.

    OMP_NUM_THREADS=1 python benchmarks/train_throughput.py --steps 6 --repeats 2

The first pass over `--steps` optimizer steps (4 conversations each) fills a teacher cache and times the target's
forward on its own; each repeat then runs the same steps again (the same batches, from the cache, from the same
weights and optimizer state) and reports tokens per CPU-second of the process (time.process_time, so other jobs on
a shared machine inflate it less than they inflate wall time) and per wall-second. Runs against any checkout:
`PYTHONPATH=/path/to/other/checkout python benchmarks/train_throughput.py` measures that version with the same
command (one that predates reading gzip-compressed conversations needs an unpacked copy of the default data: `gzip
-dc data/heads/smollm2-regenerated.jsonl.gz > /tmp/regenerated.jsonl` and `--data /tmp/regenerated.jsonl`).

Several rows per forward, side by side (`peagle train --micro-batch-size`):

    OMP_NUM_THREADS=1 python benchmarks/train_throughput.py --method peagle eagle3 --micro-batch-size 1 2 4 \\
        --max-seq-len 1024 --steps 3 --repeats 2

Every (method, micro-batch size) pair is one configuration; the passes run them in turn, forwards then backwards
(A B C C B A ...), so the machine's load falls on each alike. Each pass restarts from the same weights and optimizer
state, so the configurations train the same rows from the same head: their per-step losses must agree up to
summation order (fp32) or bf16 rounding, and the table gives the largest relative difference from the first
micro-batch size. Besides one JSON line per configuration it prints that table, with each figure's ratio to the
first micro-batch size of the same method.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time


def _recipe(args, method: str) -> dict:
    recipe = dict(num_layers=2, num_depths=12) if method == "peagle" else dict(num_layers=1, num_depths=7)
    if args.dtype:
        recipe.update(dtype=args.dtype, target_dtype="bf16")
    if args.num_depths:
        recipe.update(num_depths=args.num_depths)
    if args.cod_ratio:
        recipe.update(cod_ratio=args.cod_ratio)
    if args.freeze_lm_head:
        recipe.update(freeze_lm_head=True)
    if args.max_seq_len:
        recipe.update(max_seq_len=args.max_seq_len)
    return recipe


def _snapshot(tr) -> dict:
    """The head's weights, optimizer and schedule, to start every pass from."""
    return {"head": {k: v.detach().clone() for k, v in tr.head.state_dict().items()},
            "optimizer": copy.deepcopy(tr.optimizer.state_dict()),
            "scheduler": copy.deepcopy(tr.scheduler.state_dict())}


def _restore(tr, snap: dict) -> None:
    tr.head.load_state_dict(snap["head"])
    tr.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))  # a loaded state is stepped in place
    tr.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step = 0


def _order(n: int, repeats: int) -> list[int]:
    """Configurations 0..n-1 in turn, forwards then backwards: 0 1 2 2 1 0 0 1 2 ..."""
    out = []
    for r in range(repeats):
        out += list(range(n)) if r % 2 == 0 else list(range(n - 1, -1, -1))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/heads/smollm2-regenerated.jsonl.gz")
    p.add_argument("--method", nargs="+", choices=("peagle", "eagle3"), default=["peagle"])
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[1],
                   help="rows per forward (peagle train --micro-batch-size); several are measured side by side")
    p.add_argument("--batch-size", type=int, default=4, help="rows per optimizer step [the bundled heads' 4]")
    p.add_argument("--max-seq-len", type=int, default=None, help="tokens kept of a row [peagle train's default]")
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
    load_start = os.getloadavg()
    configs = [(method, m) for method in args.method for m in args.micro_batch_size]
    several = len(args.micro_batch_size) > 1
    if several or any(m > 1 for m in args.micro_batch_size):  # older checkouts have no --micro-batch-size
        assert hasattr(TrainConfig(), "micro_batch_size"), f"{peagle.__file__}: no --micro-batch-size"
    with tempfile.TemporaryDirectory() as tmp:
        trainers, snaps, teacher = {}, {}, {}
        for method in args.method:
            cfg = TrainConfig(data=args.data, out=f"{tmp}/out-{method}", method=method, draft_vocab_size=8192,
                              batch_size=args.batch_size, lr=1e-3, max_steps=1000,
                              teacher_cache=f"{tmp}/cache-{method}", eval_fraction=0.0, save_every=0,
                              progress=False, **_recipe(args, method))
            tr = Trainer(cfg)
            teacher_s = teacher_tokens = 0
            for _ in range(args.steps):  # fills the teacher cache, one row per forward
                m = tr.train_step()
                teacher_s += m["teacher_seconds"]
                teacher_tokens += m["tokens"]
            trainers[method], snaps[method] = tr, _snapshot(tr)
            teacher[method] = round(teacher_tokens / max(teacher_s, 1e-9), 1)
        passes = {c: [] for c in configs}
        for k in _order(len(configs), args.repeats):
            method, mb = configs[k]
            tr = trainers[method]
            _restore(tr, snaps[method])
            if hasattr(tr.cfg, "micro_batch_size"):
                tr.cfg.micro_batch_size = mb
            tokens, losses, forwards = 0, [], 0
            cpu0, wall0 = time.process_time(), time.time()
            for _ in range(args.steps):
                m = tr.train_step()
                tokens += m["tokens"]
                losses.append(m["loss"])
                forwards += m.get("forwards", 0)
            passes[configs[k]].append((tokens, time.process_time() - cpu0, time.time() - wall0, losses, forwards))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for method, mb in configs:
                tr = trainers[method]
                _restore(tr, snaps[method])
                if hasattr(tr.cfg, "micro_batch_size"):
                    tr.cfg.micro_batch_size = mb
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    tr.train_step()
                print(f"{method}, micro-batch {mb}:")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                                max_name_column_width=50))
    load_end = os.getloadavg()
    results = []
    for method, mb in configs:
        tr, runs = trainers[method], passes[(method, mb)]
        cfg = tr.cfg
        ref = passes[(method, args.micro_batch_size[0])][0][3]
        tokens = sum(r[0] for r in runs)
        cpu, wall = sum(r[1] for r in runs), sum(r[2] for r in runs)
        # the largest relative difference of a step's loss from the first micro-batch size's first pass
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for r in runs for a, b in zip(r[3], ref))
        # getattr: the same script measures older checkouts (PYTHONPATH), whose config may lack a field
        used = {k: getattr(cfg, k, None) for k in ("num_layers", "num_depths", "cod_ratio", "freeze_lm_head")}
        results.append({
            "code": peagle.__file__, "method": method, **used, "dtype": getattr(tr, "compute_dtype", cfg.dtype),
            "batch_size": cfg.batch_size, "micro_batch_size": mb, "max_seq_len": cfg.max_seq_len,
            "steps": args.steps, "repeats": args.repeats, "threads": args.threads, "tokens": tokens,
            "forwards_per_step": runs[0][4] / args.steps if runs[0][4] else None,
            "tokens_per_cpu_s": round(tokens / cpu, 1), "tokens_per_wall_s": round(tokens / wall, 1),
            "teacher_tokens_per_s": teacher[method],
            "per_pass_tokens_per_cpu_s": [round(r[0] / r[1], 1) for r in runs],
            "per_pass_tokens_per_wall_s": [round(r[0] / r[2], 1) for r in runs],
            "losses": [round(x, 6) for x in runs[0][3]], "loss_max_rel_diff": loss_diff,
            "load_average": [list(load_start), list(load_end)]})
        print(json.dumps(results[-1]))
    if len(configs) > 1:
        first = {r["method"]: r for r in results if r["micro_batch_size"] == args.micro_batch_size[0]}
        m0 = args.micro_batch_size[0]
        print(f"\n| head | micro-batch | forwards per step | tokens per CPU-second (passes) | vs {m0} | "
              f"tokens per wall-second | vs {m0} | losses: largest relative difference |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            f = first[r["method"]]
            passes_cpu = ", ".join(f"{x:.1f}" for x in r["per_pass_tokens_per_cpu_s"])
            print(f"| {r['method']} ({r['dtype']}) | {r['micro_batch_size']} | {r['forwards_per_step'] or '?'} | "
                  f"{r['tokens_per_cpu_s']:.1f} ({passes_cpu}) | "
                  f"{r['tokens_per_cpu_s'] / f['tokens_per_cpu_s']:.2f}x | {r['tokens_per_wall_s']:.1f} | "
                  f"{r['tokens_per_wall_s'] / f['tokens_per_wall_s']:.2f}x | {r['loss_max_rel_diff']:.1e} |")
        print(f"\nload average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in load_start)} at start, "
              f"{', '.join(f'{x:.2f}' for x in load_end)} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
