"""Training's costs on the embedded SmolLM2, one subcommand each (docs/training.md):

    OMP_NUM_THREADS=1 python3 benchmarks/training.py throughput --steps 3 --repeats 2      # tokens per CPU-second
    OMP_NUM_THREADS=1 python3 benchmarks/training.py throughput --method peagle eagle3 --micro-batch-size 1 2 4 \\
        --max-seq-len 1024 --steps 3 --repeats 2                                          # rows per forward
    python3 benchmarks/training.py memory --lengths 2048 8192 --partitions 1 4 16 --steps 2   # peak memory
    OMP_NUM_THREADS=1 python3 benchmarks/training.py regen --prompts data/heads/prompts.jsonl.gz --n 16 \\
        --batch-sizes 4 16 --max-new-tokens 64                                            # answers per minute

throughput: `--steps` optimizer steps (4 conversations each, the bundled heads' recipe and data) fill a teacher
cache and time the target's forward alone; then every (method, micro-batch size) configuration runs the same steps
from the same weights and optimizer state, in turn forwards then backwards (A B C C B A ...), so the machine's load
falls on each alike: tokens per CPU-second of the process and per wall-second, and since every configuration trains
the same rows from the same head, the largest relative difference of its losses from the first micro-batch size's
(summation order or bf16 rounding only). Runs against any checkout: `PYTHONPATH=/path/to/other/checkout`.
memory: each (length, partitions) in its own process (peak RSS is per process), the trainer on one sequence of
exactly `length` tokens (ShareGPT conversations rendered with SmolLM2's chat template and concatenated): the last of
`--steps` steps' wall time, tokens/s, the part spent in the target (teacher) forward, and peak memory (max RSS on
CPU, torch's max allocated on GPU).
regen: `peagle data prepare --regenerate` at several batch sizes on the same first N prompts (one turn each) with
the same generator (the engine on a CPU, transformers' batched generate() on a GPU), after one warm-up batch; wall
and process CPU time (on a shared machine only the CPU figure compares runs).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path


# ---- throughput

def recipe(args, method: str) -> dict:
    """The bundled head's recipe for `method`, with the flags given."""
    out = dict(num_layers=2, num_depths=12) if method == "peagle" else dict(num_layers=1, num_depths=7)
    if args.dtype:
        out.update(dtype=args.dtype, target_dtype="bf16")
    flags = {"num_depths": args.num_depths, "cod_ratio": args.cod_ratio, "max_seq_len": args.max_seq_len,
             "freeze_lm_head": args.freeze_lm_head or None}
    out.update({k: v for k, v in flags.items() if v})
    return out


def snapshot(tr) -> dict:
    """The head's weights, optimizer and schedule, to start every pass from."""
    return {"head": {k: v.detach().clone() for k, v in tr.head.state_dict().items()},
            "optimizer": copy.deepcopy(tr.optimizer.state_dict()),
            "scheduler": copy.deepcopy(tr.scheduler.state_dict())}


def restore(tr, snap: dict, micro_batch_size: int) -> None:
    tr.head.load_state_dict(snap["head"])
    tr.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))  # a loaded state is stepped in place
    tr.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
    tr.optimizer.zero_grad(set_to_none=True)
    tr.step = 0
    if hasattr(tr.cfg, "micro_batch_size"):  # an older checkout has none
        tr.cfg.micro_batch_size = micro_batch_size


def warm_trainers(args, tmp: str) -> tuple[dict, dict, dict]:
    """A trainer per method, its teacher cache filled by `--steps` steps; their snapshots; the target's tokens/s."""
    from peagle.train.trainer import TrainConfig, Trainer

    trainers, snaps, teacher = {}, {}, {}
    for method in args.method:
        cfg = TrainConfig(data=args.data, out=f"{tmp}/out-{method}", method=method, draft_vocab_size=8192,
                          batch_size=args.batch_size, lr=1e-3, max_steps=1000, teacher_cache=f"{tmp}/cache-{method}",
                          eval_fraction=0.0, save_every=0, progress=False, **recipe(args, method))
        tr = Trainer(cfg)
        seconds = tokens = 0
        for _ in range(args.steps):
            m = tr.train_step()
            seconds, tokens = seconds + m["teacher_seconds"], tokens + m["tokens"]
        trainers[method], snaps[method] = tr, snapshot(tr)
        teacher[method] = round(tokens / max(seconds, 1e-9), 1)
    return trainers, snaps, teacher


def throughput(args) -> None:
    import torch

    import peagle

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    configs = [(method, m) for method in args.method for m in args.micro_batch_size]
    passes: dict[tuple, list] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        trainers, snaps, teacher = warm_trainers(args, tmp)
        for r in range(args.repeats):
            for method, mb in configs if r % 2 == 0 else configs[::-1]:
                tr = trainers[method]
                restore(tr, snaps[method], mb)
                cpu0, wall0 = time.process_time(), time.time()
                steps = [tr.train_step() for _ in range(args.steps)]
                passes[method, mb].append({"tokens": sum(m["tokens"] for m in steps), "cpu": time.process_time() - cpu0,
                                           "wall": time.time() - wall0, "losses": [m["loss"] for m in steps],
                                           "forwards": sum(m.get("forwards", 0) for m in steps)})
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for method, mb in configs:
                restore(trainers[method], snaps[method], mb)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    trainers[method].train_step()
                print(f"{method}, micro-batch {mb}:\n" + prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    results = []
    for method, mb in configs:
        runs, cfg = passes[method, mb], trainers[method].cfg
        ref = passes[method, args.micro_batch_size[0]][0]["losses"]
        tokens, cpu, wall = (sum(r[k] for r in runs) for k in ("tokens", "cpu", "wall"))
        results.append({
            "code": peagle.__file__, "method": method, "dtype": getattr(trainers[method], "compute_dtype", cfg.dtype),
            **{k: getattr(cfg, k, None) for k in ("num_layers", "num_depths", "cod_ratio", "freeze_lm_head",
                                                  "batch_size", "max_seq_len")},
            "micro_batch_size": mb, "steps": args.steps, "repeats": args.repeats, "threads": args.threads,
            "tokens": tokens, "forwards_per_step": runs[0]["forwards"] / args.steps or None,
            "tokens_per_cpu_s": round(tokens / cpu, 1), "tokens_per_wall_s": round(tokens / wall, 1),
            "teacher_tokens_per_s": teacher[method],
            "per_pass_tokens_per_cpu_s": [round(r["tokens"] / r["cpu"], 1) for r in runs],
            "losses": [round(x, 6) for x in runs[0]["losses"]],
            "loss_max_rel_diff": max(abs(a - b) / max(abs(b), 1e-12) for r in runs for a, b in zip(r["losses"], ref)),
            "load_average": [list(load_start), list(os.getloadavg())]})
        print(json.dumps(results[-1]))
    if len(configs) > 1:
        throughput_table(results, args.micro_batch_size[0])


def throughput_table(results: list[dict], first_mb: int) -> None:
    first = {r["method"]: r for r in results if r["micro_batch_size"] == first_mb}
    print(f"\n| head | micro-batch | forwards per step | tokens per CPU-second (passes) | vs {first_mb} | "
          f"tokens per wall-second | vs {first_mb} | losses: largest relative difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        f = first[r["method"]]
        passes = ", ".join(f"{x:.1f}" for x in r["per_pass_tokens_per_cpu_s"])
        print(f"| {r['method']} ({r['dtype']}) | {r['micro_batch_size']} | {r['forwards_per_step'] or '?'} | "
              f"{r['tokens_per_cpu_s']:.1f} ({passes}) | {r['tokens_per_cpu_s'] / f['tokens_per_cpu_s']:.2f}x | "
              f"{r['tokens_per_wall_s']:.1f} | {r['tokens_per_wall_s'] / f['tokens_per_wall_s']:.2f}x | "
              f"{r['loss_max_rel_diff']:.1e} |")
    start, end = results[0]["load_average"]
    print(f"\nload average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in start)} at start, "
          f"{', '.join(f'{x:.2f}' for x in end)} at the end")


# ---- memory

def one_sequence(length: int, out: Path) -> dict:
    """ShareGPT conversations rendered and concatenated into one row of exactly `length` tokens, saved as data."""
    from peagle.model.loading import embedded_model_dir, load_tokenizer
    from peagle.train.data import build_rows, iter_conversations, save_rows

    ids, mask = [], []
    for row in build_rows(iter_conversations("sharegpt"), load_tokenizer(embedded_model_dir())):
        ids += row["input_ids"]
        mask += row["loss_mask"]
        if len(ids) >= length:
            break
    save_rows([{"id": "bench", "input_ids": ids[:length], "loss_mask": mask[:length]}], out,
              {"source": "sharegpt (concatenated)"})
    return {"tokens": length, "supervised": sum(mask[:length])}


def memory_one(args) -> dict:
    """One (length, partitions) configuration in this process."""
    import resource

    import torch

    from peagle.train.trainer import TrainConfig, Trainer

    cfg = TrainConfig(data=args.data, out=args.work, method=args.method, num_depths=args.num_depths,
                      max_seq_len=args.length, partitions=args.partitions[0], batch_size=1, max_steps=args.steps,
                      eval_fraction=0.0, save_every=0, progress=False, dtype=args.dtype, device=args.device,
                      draft_vocab_size=args.draft_vocab_size)
    tr = Trainer(cfg)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    if tr.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    m = [tr.train_step() for _ in range(args.steps)][-1]
    return {"length": args.length, "partitions": args.partitions[0], "method": args.method, "dtype": args.dtype,
            "device": str(tr.device), "threads": torch.get_num_threads(), "step_seconds": round(m["seconds"], 2),
            "teacher_seconds": round(m["teacher_seconds"], 2), "tokens_per_s": round(m["tokens_per_s"], 1),
            "peak_mem_gib": round(m["peak_mem_gib"], 2), "rss_after_setup_gib": round(base, 2),
            "loss": round(m["loss"], 3)}


def memory(args) -> None:
    if args.one:
        print("RESULT " + json.dumps(memory_one(args)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            data = Path(tmp) / f"data-{length}"
            print(f"# {length} tokens ({one_sequence(length, data)['supervised']} supervised)", file=sys.stderr)
            for S in args.partitions:
                cmd = [sys.executable, __file__, "memory", "--one", "--length", str(length), "--partitions", str(S),
                       "--data", str(data), "--work", str(Path(tmp) / f"run-{length}-{S}"), "--method", args.method,
                       "--num-depths", str(args.num_depths), "--steps", str(args.steps), "--dtype", args.dtype,
                       "--device", args.device, "--draft-vocab-size", str(args.draft_vocab_size)]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                          env={**os.environ, "TQDM_DISABLE": "1"})
                except subprocess.TimeoutExpired:
                    print(f"# {length} tokens, S={S}: over {args.timeout} s, skipped", file=sys.stderr)
                    continue
                res = next((json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if res is None:
                    print(f"# {length} tokens, S={S}: failed (exit {proc.returncode}): {proc.stderr[-1500:]}",
                          file=sys.stderr)
                    continue
                rows.append(res)
                print(json.dumps(res), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(res) + "\n")
    print("\n| tokens | partitions | step s | target s | tokens/s | peak memory GiB |\n|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['length']} | {r['partitions']} | {r['step_seconds']} | {r['teacher_seconds']} | "
              f"{r['tokens_per_s']} | {r['peak_mem_gib']} |")


# ---- regen

def regen(args) -> None:
    from peagle.model.loading import load_tokenizer, resolve_model
    from peagle.train.data import iter_conversations
    from peagle.train.data_cmd import make_generator, regen_device, regenerate

    target = resolve_model(None)
    tok = load_tokenizer(target)
    device = regen_device(args.device)
    convs = [(cid, [m for m in msgs if m["role"] != "assistant"][:1] + [{"role": "assistant", "content": ""}])
             for cid, msgs in islice(iter_conversations(args.prompts), args.n)]
    gen = make_generator(target, tok, max_new_tokens=args.max_new_tokens, backend=args.backend, device=device,
                         max_num_seqs=max(args.batch_sizes))
    gen([convs[0][1][:1]])  # warm-up: kernels, caches
    for bs in args.batch_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            w, c = time.time(), time.process_time()
            done = list(regenerate(iter(convs), gen, tok, Path(tmp) / "regenerated.jsonl", bs))
            wall, cpu = time.time() - w, time.process_time() - c
        print(json.dumps({"batch_size": bs, "answers": len(done), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                          "answers_per_min_wall": round(60 * len(done) / wall, 1),
                          "answers_per_min_cpu": round(60 * len(done) / cpu, 1),
                          "backend": getattr(gen, "backend", "?"), "device": device}), flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("throughput", help="tokens per CPU-second of training steps, configurations side by side")
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
    p.set_defaults(run=throughput)
    p = sub.add_parser("memory", help="step time and peak memory by sequence length and COD partitions")
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
    for name in ("--length", "--data", "--work"):  # one configuration in this process (the parent's child)
        p.add_argument(name, type=int if name == "--length" else str, help=argparse.SUPPRESS)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=memory)
    p = sub.add_parser("regen", help="answers a minute of `peagle data prepare --regenerate` per batch size")
    p.add_argument("--prompts", required=True, help="conversations (.jsonl or .jsonl.gz)")
    p.add_argument("--n", type=int, default=16, help="prompts answered per batch size")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default="auto", choices=("auto", "engine", "transformers"))
    p.set_defaults(run=regen)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
