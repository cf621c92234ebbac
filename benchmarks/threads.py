"""Plain decoding on one and two threads fixed and on the count the engine chooses step by step ("auto"), on a quiet
machine and beside CPU-bound work, under peagle's OpenMP defaults and others (docs/engine.md, "Threads"), side by
side in one run:

    python3 benchmarks/threads.py --make-model                 # once: a random SmolLM2-1.7B-shaped model under /tmp
    python3 benchmarks/threads.py --out docs/benchmarks/threads.json     # about 30 minutes on 2 cores

OpenMP reads its wait policy once, when torch is imported, so every variant is its own long-lived worker process
(this script with --worker) holding the models; the coordinator asks the workers in turn. "before" imports torch
ahead of peagle with no OMP_* variable set, as peagle ran until now (libgomp's default: spin about 300,000 times at
a barrier, then sleep); "after" imports peagle first, which fills in its defaults (peagle/threads.py); `NAME:VAR=V;...`
is a worker with those variables set (torch imported first). A round is, for each load (quiet, then HOGS CPU-bound
busy loops started by this script, unpinned, each stopped at the end of its block and bounded by --hog-limit), for
each model, every (variant, threads) cell once, their order rotated round by round. A cell decodes --tokens tokens
greedily (ignore EOS) after a short prompt; tokens/s is wall time from the first generated token to the last. A
fixed count is set as `--threads` sets it; "auto" hands the count back to the engine, whose choice carries over from
cell to cell as in a server, and before a load block's cells each worker decodes --settle-tokens untimed on "auto",
so the timed cells show an engine settled on that load (the first seconds after a load changes are not timed).
Beside each cell the script records the CPU seconds the worker used per token and how many cores other processes
(not this script's) kept busy meanwhile (from /proc/stat less our processes' times): "quiet" is only as quiet as that.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ---- every knob
DEFAULT_MODEL_DIR = Path("/tmp/peagle-threads-smollm2-1.7b-random")
SHAPE_1_7B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=64, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=130000.0, bos_token_id=1, eos_token_id=2)
MODELS = ("1.7b-q4_0", "smollm2-bf16")  # the random 1.7B shape quantized to Q4_0 at load; the embedded model
# "before": torch first, libgomp's own wait; "after": peagle's defaults; "passive": sleeping at once
VARIANTS = ("after",)
THREADS = ("1", "2", "auto")  # fixed counts, and the engine's choice step by step
HOGS = (0, 1, 2)  # busy loops per load block: 0 = quiet, 1 = one core busy, 2 = both
TOKENS = {"1.7b-q4_0": 32, "smollm2-bf16": 64}
SETTLE_TOKENS = {"1.7b-q4_0": 48, "smollm2-bf16": 128}  # untimed on "auto" before each load block's cells
PROMPT_TOKENS = 16
ROUNDS = 3
HOG_LIMIT_S = 900  # a busy loop exits on its own after this, whatever happens to this script
QUIET_WAIT_S = 180  # before a quiet block, wait this long at most for other processes to go below QUIET_CORES
QUIET_CORES = 0.2
SCRUB = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV", "MKL_NUM_THREADS",
         "PEAGLE_THREAD_DEFAULTS")
HZ = os.sysconf("SC_CLK_TCK")


# ---- the model

def make_model(out: Path, seed: int = 0) -> None:
    """A Hugging Face Llama folder (config.json + bf16 safetensors) of SmolLM2-1.7B's shape, random weights."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = SHAPE_1_7B
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "dtype": "bfloat16",
              "attention_bias": False, "mlp_bias": False, **{k: v for k, v in c.items() if k != "rope_theta"},
              "rope_parameters": {"rope_theta": c["rope_theta"], "rope_type": "default"}}
    g = torch.Generator().manual_seed(seed)
    H, I, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(nh * D, H), p + "self_attn.k_proj.weight": w(nkv * D, H),
                      p + "self_attn.v_proj.weight": w(nkv * D, H), p + "self_attn.o_proj.weight": w(H, nh * D),
                      p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                      p + "mlp.down_proj.weight": w(H, I),
                      p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    n = sum(t.numel() for t in state.values())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, {(out / 'model.safetensors').stat().st_size / 2 ** 30:.2f} GiB")


# ---- how long libgomp's spinning lasts here

SPIN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static volatile int flag = 0;
int main(int argc, char **argv) {  /* libgomp's do_spin: a relaxed load and a PAUSE per iteration */
    long count = atol(argv[1]), best = 1L << 60;
    for (int r = 0; r < 200; r++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < count; i++) {
            if (__atomic_load_n(&flag, __ATOMIC_RELAXED) != 0) return 1;
            __asm volatile("rep; nop" ::: "memory");
        }
        clock_gettime(CLOCK_MONOTONIC, &b);
        long ns = (b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec);
        if (ns < best) best = ns;
    }
    printf("%.2f\n", best / 1000.0);
    return 0;
}
"""


def spin_microseconds(counts: list[int]) -> dict[int, float] | None:
    """Microseconds `count` spins of libgomp's wait loop take on this CPU (best of 200), or None without a C
    compiler or off x86-64."""
    import shutil
    import tempfile

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or platform.machine() not in ("x86_64", "AMD64"):
        return None
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "spin.c", Path(d) / "spin"
        src.write_text(SPIN_C)
        if subprocess.run([cc, "-O2", str(src), "-o", str(exe)], capture_output=True).returncode:
            return None
        return {n: float(subprocess.run([str(exe), str(n)], capture_output=True, text=True).stdout) for n in counts}


# ---- the worker: one process per variant, holding the models, decoding on request

def worker(args) -> None:
    variant = args.worker
    if variant == "after":
        import peagle  # noqa: F401  (fills in the defaults before torch)
        import torch
    else:
        import torch
        import peagle  # noqa: F401
    from peagle import threads
    from peagle.engine import LLMEngine, SamplingParams
    from peagle.model import kernels
    from peagle.model.loading import embedded_model_dir
    from peagle.model.target import TargetModel

    engines = {}
    for name in args.models:
        if name == "1.7b-q4_0":
            target = TargetModel.from_pretrained(args.model_dir, quantization="q4_0")
        elif name == "smollm2-bf16":
            target = TargetModel.from_pretrained(embedded_model_dir())
        else:
            raise SystemExit(f"unknown model {name}")
        engines[name] = LLMEngine(target, None, max_num_seqs=1, max_model_len=1024, enable_prefix_caching=False)
    prompt = list(range(100, 100 + PROMPT_TOKENS))

    def use(count: str) -> None:
        if count == "auto":
            threads.set_threads(threads.default_threads(), "default")  # the engine's to choose
        else:
            threads.set_threads(int(count), "benchmark")

    for name, engine in engines.items():  # warm-up on every thread count
        for t in args.threads:
            use(t)
            engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    out = sys.stdout
    print(json.dumps({"ready": variant, "pid": os.getpid(), "env": {k: os.environ.get(k) for k in SCRUB},
                      "threads": threads.summary(), "kernels": kernels.describe()}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        use(req["threads"])
        engine = engines[req["model"]]
        params = SamplingParams(max_tokens=req["tokens"], ignore_eos=True)
        if req.get("settle"):
            engine.generate([prompt], params)
            print(json.dumps(engine.step_threads.summary()), file=out, flush=True)
            continue
        stamps = []
        cpu0 = time.process_time()
        for o in engine.stream(prompt, params, chat=False):
            stamps.append((time.perf_counter(), o.num_output_tokens))
        cpu = time.process_time() - cpu0
        (t0, n0), (t1, n1) = stamps[0], stamps[-1]
        print(json.dumps({"tokens_per_s": (n1 - n0) / (t1 - t0), "tokens": n1, "cpu_s_per_token": cpu / n1,
                          "wall_s": t1 - t0, **(engine.step_threads.summary() if req["threads"] == "auto" else {})}),
              file=out, flush=True)


# ---- the coordinator

def _jiffies() -> tuple[int, int]:
    """All CPUs' busy time (user, nice, system, irq, softirq; guest time is inside user) and the time the
    hypervisor gave the virtual CPUs to others (steal), in clock ticks."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6], v[7] if len(v) > 7 else 0


def other_cores_busy(seconds: float) -> float:
    """Cores other processes kept busy over `seconds` while this script slept."""
    b0, t0 = _jiffies()[0], time.perf_counter()
    time.sleep(seconds)
    return (_jiffies()[0] - b0) / HZ / (time.perf_counter() - t0)


def wait_quiet(limit: float, threshold: float) -> float:
    """Wait up to `limit` seconds for other processes to use under `threshold` cores; returns the last reading."""
    deadline, busy = time.time() + limit, other_cores_busy(2.0)
    while busy >= threshold and time.time() < deadline:
        busy = other_cores_busy(5.0)
    return busy


def _proc_jiffies(pid: int) -> int:
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])  # utime + stime, all threads
    except OSError:
        return 0


class Worker:
    def __init__(self, variant: str, args):
        env = {k: v for k, v in os.environ.items() if k not in SCRUB}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        name = variant
        if ":" in variant:
            name, assigns = variant.split(":", 1)
            env.update(dict(a.split("=", 1) for a in assigns.split(";") if a))
        self.name = name
        cmd = [sys.executable, __file__, "--worker", name, "--model-dir", str(args.model_dir), "--models",
               *args.models, "--threads", *args.threads]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT)
        self.info = json.loads(self.proc.stdout.readline())
        print(f"  worker {name} ready (pid {self.proc.pid}): {self.info['threads']}", flush=True)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.name} died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_hogs(n: int, limit: float) -> list[subprocess.Popen]:
    code = f"import time\nt = time.time() + {limit}\nwhile time.time() < t: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
    for h in hogs:
        h.wait()


def measure(w: Worker, hogs: list, model: str, threads: str, tokens: int) -> dict:
    ours = [w.proc.pid, *(h.pid for h in hogs)]
    (busy0, steal0), ours0, t0 = _jiffies(), sum(map(_proc_jiffies, ours)), time.perf_counter()
    r = w.ask(model=model, threads=threads, tokens=tokens)
    wall = time.perf_counter() - t0
    busy, steal = _jiffies()
    other = (busy - busy0) - (sum(map(_proc_jiffies, ours)) - ours0)
    r["other_cores_busy"] = max(0.0, other / HZ / wall)
    r["steal_cores"] = (steal - steal0) / HZ / wall
    return r


def cell_key(model: str, hogs: int, variant: str, threads: str) -> str:
    return f"{model}|{hogs}|{variant}|{threads}"


def summarize(samples: dict) -> dict:
    cells = {}
    for key, rs in samples.items():
        tps = [r["tokens_per_s"] for r in rs]
        cells[key] = {"tokens_per_s": statistics.median(tps), "all": [round(x, 4) for x in tps],
                      "cpu_s_per_token": statistics.median(r["cpu_s_per_token"] for r in rs),
                      "other_cores_busy": statistics.median(r["other_cores_busy"] for r in rs),
                      "other_cores_all": [round(r["other_cores_busy"], 2) for r in rs],
                      "steal_cores": statistics.median(r["steal_cores"] for r in rs),
                      # auto: the count the engine ran on at the cell's end, and its probes and moves so far
                      **({"threads_now_all": [r["threads_now"] for r in rs],
                          "thread_probes_all": [r["thread_probes"] for r in rs],
                          "thread_moves_all": [r["thread_moves"] for r in rs]} if "threads_now" in rs[0] else {})}
    return cells


def load_name(hogs: int) -> str:
    return "quiet" if hogs == 0 else f"busy ({hogs} busy loop{'s' if hogs > 1 else ''})"


def ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's tokens/s over b's in the same round (measured minutes apart at most)."""
    return statistics.median(x / y for x, y in zip(a["all"], b["all"]))


def thr(count: str) -> str:
    return "auto" if count == "auto" else f"{count} thr"


def markdown(res: dict) -> str:
    """Two tables: medians of tokens/s per cell (and how many cores other processes kept busy meanwhile), then the
    ratios, each the median of the rounds' own ratios (cells of one round run minutes apart at most)."""
    cells, variants, threads = res["cells"], res["variants"], [str(t) for t in res["threads"]]
    fixed = [t for t in threads if t != "auto"]
    t1, t2 = fixed[0], fixed[-1]
    # the fixed counts against each other, and the engine's choice against each fixed count
    pairs = [(t2, t1), *(("auto", t) for t in fixed if "auto" in threads)]
    rows = [(model, hogs, {(v, t): cells[cell_key(model, hogs, v, t)] for v in variants for t in threads})
            for model in res["models"] for hogs in res["hogs"]]
    head = ["model", "load", *(f"{v}, {thr(t)}" for v in variants for t in threads), "other processes, cores"]
    speed = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for model, hogs, c in rows:
        speed.append("| " + " | ".join([model, load_name(hogs), *(f"{c[v, t]['tokens_per_s']:.1f}" for v in variants
                                                                   for t in threads),
                                        f"{statistics.median(x['other_cores_busy'] for x in c.values()):.2f}"]) + " |")
    head = ["model", "load", *(f"{v}: {thr(a)} / {thr(b)}" for v in variants for a, b in pairs),
            *(f"{v} / {variants[0]}, {thr(t2)}" for v in variants[1:])]
    ratios = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for model, hogs, c in rows:
        cols = [*(f"{ratio(c[v, a], c[v, b]):.2f}x" for v in variants for a, b in pairs),
                *(f"{ratio(c[v, t2], c[variants[0], t2]):.2f}x" for v in variants[1:])]
        ratios.append("| " + " | ".join([model, load_name(hogs), *cols]) + " |")
    return "tokens/s (medians)\n\n" + "\n".join(speed) + "\n\nratios\n\n" + "\n".join(ratios)


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-model", action="store_true", help="write the random 1.7B-shaped model to --model-dir")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                    help="before, after, or NAME:VAR=VALUE;VAR=VALUE (default: %(default)s)")
    ap.add_argument("--threads", nargs="+", default=list(THREADS),
                    help="thread counts, and auto: the engine's choice (default: %(default)s)")
    ap.add_argument("--settle-tokens-1.7b", dest="settle_big", type=int, default=SETTLE_TOKENS["1.7b-q4_0"])
    ap.add_argument("--settle-tokens-smollm2", dest="settle_small", type=int, default=SETTLE_TOKENS["smollm2-bf16"])
    ap.add_argument("--hogs", nargs="+", type=int, default=list(HOGS),
                    help="busy loops per load block, 0 = quiet (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--tokens-1.7b", dest="tokens_big", type=int, default=TOKENS["1.7b-q4_0"])
    ap.add_argument("--tokens-smollm2", dest="tokens_small", type=int, default=TOKENS["smollm2-bf16"])
    ap.add_argument("--hog-limit", type=float, default=HOG_LIMIT_S, help="seconds a busy loop lives at most")
    ap.add_argument("--quiet-wait", type=float, default=QUIET_WAIT_S,
                    help=f"seconds to wait at most, before each quiet block, for other processes to use under "
                         f"{QUIET_CORES} cores (default {QUIET_WAIT_S:g}; 0: do not wait)")
    ap.add_argument("--fresh-workers", action=argparse.BooleanOptionalAction, default=True,
                    help="start the workers afresh every round, in turn first (default: on: two processes' speeds on "
                         "one thread differed by more than 15%% whatever their settings)")
    ap.add_argument("--out", type=Path, help="JSON result file (e.g. docs/benchmarks/threads.json)")
    ap.add_argument("--render", type=Path, metavar="JSON", help="print the tables of a result file, and run nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.render:
        return print(markdown(json.loads(args.render.read_text())))
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the busy loops and workers are stopped
    if args.make_model:
        return make_model(args.model_dir)
    if "1.7b-q4_0" in args.models and not (args.model_dir / "config.json").exists():
        raise SystemExit(f"no model in {args.model_dir}: run with --make-model first")
    tokens = {"1.7b-q4_0": args.tokens_big, "smollm2-bf16": args.tokens_small}
    settle = {"1.7b-q4_0": args.settle_big, "smollm2-bf16": args.settle_small}
    command = "python3 benchmarks/threads.py " + " ".join(a if " " not in a else repr(a) for a in sys.argv[1:])
    spins = spin_microseconds([1000, 3000, 10000, 300000])
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; load average {os.getloadavg()}; libgomp's spin counts take "
          + (", ".join(f"{n}: {us:.0f} us" for n, us in spins.items()) if spins else "(not measured)"), flush=True)
    workers: list[Worker] = []
    samples: dict[str, list] = {}
    loads, infos = [], []
    t_start = time.time()
    try:
        for rnd in range(args.rounds):
            if args.fresh_workers or rnd == 0:
                # one at a time (the 1.7B model's bf16 file is read and quantized at load), in turn first
                print(f"round {rnd + 1}/{args.rounds}: starting workers", flush=True)
                rot = rnd % len(args.variants)
                started = {w.name: w for w in (Worker(v, args) for v in args.variants[rot:] + args.variants[:rot])}
                workers = [started[v.split(":", 1)[0]] for v in args.variants]
                infos.append({w.name: w.info for w in workers})
            order = [(w, t) for w in workers for t in args.threads]
            for hogs_n in args.hogs:
                before = wait_quiet(args.quiet_wait, QUIET_CORES) if hogs_n == 0 else None
                if before is not None:
                    print(f"  other processes before the quiet block: {before:.2f} cores", flush=True)
                hogs = start_hogs(hogs_n, args.hog_limit)
                try:
                    time.sleep(0.5 if hogs_n else 0)
                    loads.append({"round": rnd, "hogs": hogs_n, "loadavg_1min": os.getloadavg()[0],
                                  **({"other_cores_before": round(before, 2)} if before is not None else {})})
                    for model in args.models:
                        for w in workers if "auto" in args.threads else ():
                            chose = w.ask(model=model, threads="auto", tokens=settle[model], settle=True)
                            print(f"  {w.name} {model} settled on auto: {chose}", flush=True)
                        rot = rnd % len(order)
                        for w, t in order[rot:] + order[:rot]:
                            r = measure(w, hogs, model, t, tokens[model])
                            samples.setdefault(cell_key(model, hogs_n, w.name, t), []).append(r)
                            print(f"  round {rnd + 1}/{args.rounds} {load_name(hogs_n)} {model} {w.name} {thr(t)}: "
                                  f"{r['tokens_per_s']:.2f} tok/s, {r['cpu_s_per_token'] * 1000:.0f} ms CPU/token, "
                                  f"other work {r['other_cores_busy']:.2f} cores, steal {r['steal_cores']:.2f}"
                                  + (f", now on {r['threads_now']}" if "threads_now" in r else ""), flush=True)
                finally:
                    stop_hogs(hogs)
            if args.fresh_workers:
                for w in workers:
                    w.close()
                workers = []
    finally:
        for w in workers:
            w.close()
    res = {"command": command, "cpu": cpu_name(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "models": args.models, "variants": [v.split(":", 1)[0] for v in args.variants],
           "variant_env": {v.split(":", 1)[0]: (v.split(":", 1)[1] if ":" in v else v) for v in args.variants},
           "threads": args.threads, "hogs": args.hogs, "rounds": args.rounds, "fresh_workers": args.fresh_workers,
           "tokens": {m: tokens[m] for m in args.models}, "settle_tokens": {m: settle[m] for m in args.models},
           "spin_microseconds": spins, "workers": infos, "loads": loads,
           "seconds": round(time.time() - t_start), "cells": summarize(samples)}
    table = markdown(res)
    res["table"] = table
    print(table)
    print(f"load average at end {os.getloadavg()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
