"""`peagle bench`: output tokens/s against concurrency for no speculation, EAGLE-3 and P-EAGLE at several K, plus
transformers' own generate() on the same model and prompts, in one run and one table (docs/design.md,
"Benchmark definitions").

Modes:
  default    every configuration (method x K) gets its own `peagle serve` subprocess on a free 127.0.0.1 port, and
             the load generator talks to it over HTTP with streaming, as a real client would;
  --url U    one running server (peagle's or vLLM's): its configuration is read from /v1/models where it says;
  --offline  the engine in this process, no HTTP (the same clients, stepping the engine directly).
transformers methods always run in this process.

Before the sweep a short calibration (a few tokens per configuration, in this process) gives an estimate of how
long the sweep will take; a progress bar counts requests while it runs. Results go to --out: results.md (the
table), results.json, PNG plots, and the servers' logs.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peagle.bench.metrics import METHOD_NAMES, SPEC_METHODS, RunMetrics, config_label, summarize
from peagle.model.heads import is_untrained

METHODS = ("baseline", "eagle3", "peagle", "transformers", "transformers-pld")
DEFAULT_METHODS = "baseline,eagle3,peagle,transformers,transformers-pld"
CALIBRATION_TOKENS = 8


class BenchError(Exception):
    """A problem the user can fix; printed without a traceback."""


def register(name: str, parser: argparse.ArgumentParser) -> None:
    from peagle.bench.datasets import dataset_names

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", default="humaneval", help=f"prompt set: {dataset_names()} (default humaneval)")
    g.add_argument("--num-prompts", type=int, default=16, help="requests per run (default 16)")
    g.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (default 128)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per request")
    g.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts (default 1,4,8)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--seed", type=int, default=0, help="request i uses seed+i when sampling (default 0)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="send prompts through the chat template (default: when the model has one)")
    g = parser.add_argument_group("what to compare")
    g.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated, from {', '.join(METHODS)} (default: all)")
    g.add_argument("--k", default="3,7,11", help="speculative tokens K for eagle3 and peagle (default 3,7,11)")
    g.add_argument("--model", help="target model folder or cached id (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--peagle-head", help="P-EAGLE head folder or bundled name (default: the bundled head)")
    g.add_argument("--eagle3-head", help="EAGLE-3 head folder or bundled name (default: the bundled head)")
    g.add_argument("--random-heads", action="store_true",
                   help="where a method has no head, create an UNTRAINED random one (measures the mechanics only: "
                        "its drafts are hardly ever accepted); the report says so")
    g.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="transformers-pld: prompt_lookup_num_tokens (default 10)")
    g = parser.add_argument_group("how to run")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--url", help="benchmark a running OpenAI-compatible server (one configuration)")
    mode.add_argument("--offline", action="store_true", help="drive the engine in this process, without HTTP")
    g.add_argument("--api-key", help="bearer key for --url")
    g.add_argument("--max-model-len", type=int, help="context per request (default: longest prompt + max tokens)")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16, float16 or float32")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=int,
                   help="torch CPU threads, here and in the servers (default: torch's; on a shared machine 1 avoids "
                        "threads waiting for busy cores)")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests per configuration (default 1)")
    g.add_argument("--no-estimate", action="store_true", help="skip the calibration that estimates the sweep time")
    g.add_argument("--estimate-only", action="store_true", help="calibrate, print the estimate and stop")
    g.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    g.add_argument("--note", action="append", default=[], help="a note to print in the report (repeatable)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        return _run(args)
    except BenchError as e:
        print(f"peagle bench: error: {e}", file=sys.stderr, flush=True)
        return 2


# -- planning -----------------------------------------------------------------------------------------------------

def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise BenchError(f"{flag} values must be positive integers, got {text!r}")
    return vals


@dataclass
class Config:
    method: str
    k: int = 0
    head: str | None = None

    @property
    def label(self) -> str:
        return config_label(self.method, self.k)

    def speculative_config(self) -> dict | None:
        if self.method not in SPEC_METHODS:
            return None
        return {"model": self.head, "method": "eagle3", "num_speculative_tokens": self.k,
                "parallel_drafting": self.method == "peagle"}


@dataclass
class Plan:
    mode: str  # server, url, offline
    prompts: list
    concurrencies: list[int]
    configs: list[Config]
    chat: bool
    max_model_len: int | None
    model_path: Path | None
    heads: dict = field(default_factory=dict)  # method -> {"path", "untrained"}
    notes: list[str] = field(default_factory=list)
    server_startup_s: dict = field(default_factory=dict)

    def concurrencies_for(self, cfg: Config) -> list[int]:
        return [1] if cfg.method == "transformers-pld" else self.concurrencies


def canonical_command(args) -> str:
    """The command that reproduces this run (every option that matters, in a fixed order)."""
    parts = ["peagle", "bench", "--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
             "--max-tokens", str(args.max_tokens), "--concurrency", args.concurrency, "--methods", args.methods,
             "--k", args.k, "--temperature", str(args.temperature), "--seed", str(args.seed)]
    for flag, value in (("--model", args.model), ("--peagle-head", args.peagle_head),
                        ("--eagle3-head", args.eagle3_head), ("--url", args.url),
                        ("--max-model-len", args.max_model_len), ("--device", args.device),
                        ("--threads", args.threads)):
        if value is not None:
            parts += [flag, str(value)]
    if args.dtype != "auto":
        parts += ["--dtype", args.dtype]
    for flag, on in (("--ignore-eos", args.ignore_eos), ("--random-heads", args.random_heads),
                     ("--offline", args.offline)):
        if on:
            parts.append(flag)
    if args.chat is not None:
        parts.append("--chat" if args.chat else "--no-chat")
    if args.prompt_lookup_tokens != 10:
        parts += ["--prompt-lookup-tokens", str(args.prompt_lookup_tokens)]
    parts += ["--out", args.out]
    return shlex.join(parts)


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    d = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
         "transformers": transformers.__version__, "python": platform.python_version(),
         "platform": platform.platform(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    d["load_average"] = _loadavg()
    d["summary"] = (f"{d['cuda'] or cpu}, {d['cpu_count']} CPU cores, torch {d['torch']} ({d['torch_threads']} "
                    f"threads), transformers {d['transformers']}, Python {d['python']}")
    return d


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def make_plan(args, target_holder: "TargetHolder") -> Plan:
    from peagle.bench.datasets import DatasetError, load_dataset

    if args.max_tokens < 1:
        raise BenchError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    concurrencies = _int_list(args.concurrency, "--concurrency")
    ks = _int_list(args.k, "--k")
    methods = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    methods = ["peagle" if m == "p-eagle" else "eagle3" if m in ("eagle-3", "eagle") else
               "baseline" if m in ("none", "no-spec") else m for m in methods]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise BenchError(f"unknown method(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(METHODS)}")
    methods = [m for m in METHODS if m in methods]
    try:
        prompts = load_dataset(args.dataset, args.num_prompts)
    except DatasetError as e:
        raise BenchError(str(e)) from None
    notes = list(args.note)
    mode = "url" if args.url else "offline" if args.offline else "server"

    model_path = None
    if mode != "url" or args.model:  # with --url, a local copy of the model is optional (tokenizer, transformers)
        try:
            from peagle.model.loading import resolve_model

            model_path = resolve_model(args.model)
        except FileNotFoundError as e:
            if mode != "url":
                raise BenchError(str(e)) from None
    tokenizer = target_holder.tokenizer(model_path) if model_path else None

    chat = args.chat
    if chat is None:
        chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)) if tokenizer else True
    if chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise BenchError("--chat: this model's tokenizer has no chat template; use --no-chat")

    max_model_len = args.max_model_len
    if tokenizer is not None:
        lengths = [len(_encode(tokenizer, p, chat)) for p in prompts]
        if max_model_len is None:
            need = max(lengths) + args.max_tokens + 8
            max_model_len = -(-need // 64) * 64
        else:
            keep = [p for p, n in zip(prompts, lengths) if n + args.max_tokens <= max_model_len]
            if len(keep) < len(prompts):
                notes.append(f"{len(prompts) - len(keep)} prompt(s) longer than --max-model-len {max_model_len} "
                             f"minus --max-tokens were left out")
            if not keep:
                raise BenchError(f"no prompt fits --max-model-len {max_model_len} with --max-tokens {args.max_tokens}")
            prompts = keep

    configs: list[Config] = []
    heads: dict = {}
    if mode == "url":
        configs = [Config("server")]  # resolved from the server at run time
        local = [m for m in methods if m.startswith("transformers") and args.methods != DEFAULT_METHODS]
        if local and model_path is not None:
            configs += [Config(m) for m in local]
    else:
        for m in methods:
            if m in SPEC_METHODS:
                path, untrained = _resolve_head(args, m, model_path, target_holder, Path(args.out))
                heads[m] = {"path": str(path), "untrained": untrained}
                configs += [Config(m, k, str(path)) for k in ks]
            else:
                configs.append(Config(m))
    if any(h["untrained"] for h in heads.values()):
        notes.append("heads marked UNTRAINED have random weights: their drafts are almost never accepted "
                     "(acceptance length about 1), so these numbers show only what drafting and verifying cost, "
                     "not what speculation gains")
    return Plan(mode, prompts, concurrencies, configs, chat, max_model_len, model_path, heads, notes)


def _encode(tokenizer, prompt, chat: bool) -> list[int]:
    if not chat:
        return tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
    text = tokenizer.apply_chat_template(prompt.chat_messages(), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _resolve_head(args, method: str, model_path: Path | None, holder: "TargetHolder", out: Path) -> tuple[Path, bool]:
    from peagle.model.heads import resolve_head

    given = args.peagle_head if method == "peagle" else args.eagle3_head
    try:
        path = resolve_head(given, args.model, method=method)
        return path, is_untrained(path)
    except FileNotFoundError as e:
        if given is not None or not args.random_heads:
            flag = "--peagle-head" if method == "peagle" else "--eagle3-head"
            raise BenchError(f"{METHOD_NAMES[method]}: {e}. Pass {flag} DIR, or --random-heads to measure with an "
                             "untrained head") from None
    return create_random_head(method, model_path, holder, out / "heads" / f"{method}-untrained"), True


def create_random_head(method: str, model_path: Path, holder: "TargetHolder", dest: Path) -> Path:
    """An untrained head (random weights, the target's embeddings) saved to dest, marked untrained in config."""
    from peagle.model.checkpoint import random_head, save_head
    from peagle.model.mask_token import choose_mask_token_id

    target = holder.target(model_path)
    mask_id = choose_mask_token_id(holder.tokenizer(model_path), target.config.vocab_size) \
        if method == "peagle" else None
    head = random_head(target.config, target.embed_tokens.weight, method=method, mask_token_id=mask_id, seed=0)
    save_head(head, dest)
    return dest


class TargetHolder:
    """Loads the target and tokenizer once for everything done in this process (heads, calibration, offline)."""

    def __init__(self, dtype: str = "auto", device: str | None = None):
        self.dtype, self.device = dtype, device
        self._target = self._tok = None
        self.load_s = 0.0

    def tokenizer(self, model_path: Path):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(model_path)
        return self._tok

    def target(self, model_path: Path):
        if self._target is None:
            import torch

            from peagle.model.loading import torch_dtype
            from peagle.model.target import TargetModel

            t0 = time.perf_counter()
            device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
            self._target = TargetModel.from_pretrained(model_path, dtype=torch_dtype(self.dtype), device=device)
            self.load_s = time.perf_counter() - t0
        return self._target

    def engine(self, model_path: Path, cfg: Config, max_num_seqs: int, max_model_len: int | None):
        from peagle.config import SpeculativeConfig
        from peagle.engine.engine import LLMEngine
        from peagle.model.loading import torch_dtype
        from peagle.model.checkpoint import load_head

        target = self.target(model_path)
        tok = self.tokenizer(model_path)
        spec = drafter = None
        if cfg.method in SPEC_METHODS:
            spec = SpeculativeConfig.parse(cfg.speculative_config())
            drafter = load_head(cfg.head, target_embeddings=target.embed_tokens.weight, dtype=torch_dtype(self.dtype),
                                device=target.embed_tokens.weight.device)
        return LLMEngine(target, tok, drafter, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         model_name=Path(model_path).name)


# -- calibration and the estimate ---------------------------------------------------------------------------------

def _params(args, max_tokens: int | None = None, seed: int | None = None, ignore_eos: bool | None = None):
    from peagle.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=args.temperature,
                          seed=seed, ignore_eos=args.ignore_eos if ignore_eos is None else ignore_eos)


def _measure(run_fn, c: int) -> dict:
    """Time CALIBRATION_TOKENS tokens for c requests at once: prefill seconds per request, decode tokens/s."""
    t0 = time.perf_counter()
    results = run_fn(c)
    total = time.perf_counter() - t0
    prefill = max((r.ttft or 0.0) for r in results)
    tokens = sum(r.output_tokens for r in results) - len(results)
    decode = max(total - prefill, 1e-6)
    return {"prefill_s": prefill / max(c, 1), "decode_tps": max(tokens, 1) / decode}


def calibrate(args, plan: Plan, holder: TargetHolder, hf_holder: dict) -> dict:
    """Per (method, K) and concurrency in {1, max}: prefill time per request and decode tokens/s, from a few tokens
    in this process. K in between the smallest and largest is interpolated."""
    from peagle.bench.loadgen import run_offline

    cmax = max(plan.concurrencies)
    cal_cs = sorted({1, cmax})
    out: dict = {}
    cal_prompts = (plan.prompts * cmax)[:cmax]
    for cfg in plan.configs:
        if cfg.method in SPEC_METHODS:
            ks = sorted(c.k for c in plan.configs if c.method == cfg.method)
            if cfg.k not in (ks[0], ks[-1]):
                continue
        if cfg.method == "transformers-pld":
            cs = [1]
        else:
            cs = cal_cs
        if cfg.method.startswith("transformers"):
            runner = _hf_runner(args, plan, hf_holder)
            lookup = args.prompt_lookup_tokens if cfg.method == "transformers-pld" else None

            def run_fn(c, runner=runner, lookup=lookup):
                return runner.run(cal_prompts[:c], c, CALIBRATION_TOKENS, args.temperature, args.seed, plan.chat,
                                  ignore_eos=True, prompt_lookup=lookup)[0]
        else:
            engine = holder.engine(plan.model_path, cfg, cmax, plan.max_model_len)

            def run_fn(c, engine=engine):
                return run_offline(engine, cal_prompts[:c], c,
                                   lambda i: _params(args, CALIBRATION_TOKENS, args.seed + i, True), plan.chat)[0]
        run_fn(1)  # warm-up
        for c in cs:
            out[(cfg.method, cfg.k, c)] = _measure(run_fn, c)
        if not cfg.method.startswith("transformers"):
            del engine
            gc.collect()
    return out


def _interp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def estimate_run(cal: dict, plan: Plan, cfg: Config, c: int, n: int, max_tokens: int) -> float:
    """Seconds for one run: n requests of up to max_tokens tokens at concurrency c."""
    cmax = max(plan.concurrencies)

    def at(k: int, cc: int) -> dict:
        return cal[(cfg.method, k, cc)]

    if cfg.method in SPEC_METHODS:
        ks = sorted(x.k for x in plan.configs if x.method == cfg.method)
        k0, k1 = ks[0], ks[-1]
    else:
        k0 = k1 = cfg.k
    cs = (1, cmax) if cfg.method != "transformers-pld" else (1, 1)

    def point(cc: int) -> dict:
        a, b = at(k0, cc), at(k1, cc)
        return {"prefill_s": _interp(cfg.k, k0, k1, a["prefill_s"], b["prefill_s"]),
                # time per token is about linear in K (K drafts, K+1 rows to verify)
                "decode_tps": 1.0 / _interp(cfg.k, k0, k1, 1.0 / a["decode_tps"], 1.0 / b["decode_tps"])}

    p0, p1 = point(cs[0]), point(cs[1])
    tps = _interp(c, cs[0], cs[1], p0["decode_tps"], p1["decode_tps"])
    prefill = _interp(c, cs[0], cs[1], p0["prefill_s"], p1["prefill_s"])
    return n * prefill + n * max_tokens / max(tps, 1e-6)


def server_import_s(threads: int | None) -> float:
    """Seconds a fresh Python takes to import the server's stack: most of a server start besides loading."""
    import subprocess

    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import peagle.serve.app, peagle.engine.engine, uvicorn"], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0 + 1.0


def _hf_runner(args, plan: Plan, hf_holder: dict):
    if "runner" not in hf_holder:
        from peagle.bench.loadgen import HFRunner
        from peagle.model.loading import torch_dtype

        device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
        hf_holder["runner"] = HFRunner(plan.model_path, dtype=torch_dtype(args.dtype), device=device)
    return hf_holder["runner"]


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


# -- the sweep ----------------------------------------------------------------------------------------------------

def _run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = _dt.datetime.now().astimezone()
    t_start = time.perf_counter()
    holder = TargetHolder(args.dtype, args.device)
    hf_holder: dict = {}
    plan = make_plan(args, holder)
    runs_planned = [(cfg, c) for cfg in plan.configs for c in plan.concurrencies_for(cfg)]
    n = len(plan.prompts)
    total_requests = n * len(runs_planned)
    log = sys.stderr
    print(f"peagle bench: {len(plan.configs)} configuration(s) x concurrency {plan.concurrencies} = "
          f"{len(runs_planned)} runs of {n} {args.dataset} prompts, up to {args.max_tokens} tokens each "
          f"({plan.mode} mode{', chat template' if plan.chat else ''})", file=log, flush=True)
    for note in plan.notes:
        print(f"peagle bench: note: {note}", file=log, flush=True)

    estimate = None
    if args.estimate_only and (args.no_estimate or plan.mode == "url"):
        raise BenchError("--estimate-only calibrates in this process: not with --no-estimate or --url")
    if not args.no_estimate and plan.mode != "url":
        t0 = time.perf_counter()
        print("peagle bench: calibrating (a few tokens per configuration) to estimate the sweep time...", file=log,
              flush=True)
        cal = calibrate(args, plan, holder, hf_holder)
        cal_s = time.perf_counter() - t0
        estimate = sum(estimate_run(cal, plan, cfg, c, n, args.max_tokens) for cfg, c in runs_planned)
        estimate += args.warmup * len(plan.configs) * 2.0
        if plan.mode == "server":
            starts = sum(1 for c in plan.configs if not c.method.startswith("transformers"))
            estimate += starts * (server_import_s(args.threads) + holder.load_s)
        print(f"peagle bench: calibration took {cal_s:.0f} s. Estimated sweep time: about {_fmt_s(estimate)} "
              f"(every request running to --max-tokens; less when requests stop early)", file=log, flush=True)
        if args.estimate_only:
            per_run = {f"{cfg.label} c={c}": round(estimate_run(cal, plan, cfg, c, n, args.max_tokens), 1)
                       for cfg, c in runs_planned}
            print(json.dumps({"estimate_s": round(estimate, 1), "calibration_s": round(cal_s, 1),
                              "runs_s": per_run}, indent=1))
            return 0

    t_sweep = time.perf_counter()
    bar = _progress_bar(total_requests, args.no_progress)
    meta = {"command": canonical_command(args), "dataset": args.dataset, "num_prompts": n,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "seed": args.seed, "chat": plan.chat, "mode": plan.mode, "concurrency": plan.concurrencies,
            "model": str(args.model or (f"served at {args.url}" if args.url else
                                        f"embedded SmolLM2-135M-Instruct ({plan.model_path})")),
            "max_model_len": plan.max_model_len, "heads": plan.heads, "notes": plan.notes,
            "started": started.isoformat(timespec="seconds"), "machine": machine(),
            "estimate_s": round(estimate, 1) if estimate else None}
    results: list[RunMetrics] = []
    try:
        for cfg in plan.configs:
            cs = plan.concurrencies_for(cfg)
            try:
                for r in _run_config(args, plan, cfg, cs, holder, hf_holder, bar, out):
                    results.append(r)
                    bar.set_postfix_str(f"{r.label} c={r.concurrency}: {r.otps:.1f} tok/s")
                    _save_partial(results, meta, out)
            except BenchError as e:
                if plan.mode == "url":
                    raise
                # One broken configuration must not cost the rest of a long sweep: note it and go on.
                plan.notes.append(f"{cfg.label} was not measured: {str(e).splitlines()[0]}")
                print(f"\npeagle bench: {cfg.label} failed, skipping it: {e}", file=log, flush=True)
                bar.update(len(plan.prompts) * len(cs) - sum(1 for r in results if r.label == cfg.label) *
                           len(plan.prompts))
    finally:
        bar.close()
    if not results:
        raise BenchError("no configuration could be measured (see above)")
    wall = time.perf_counter() - t_start
    sweep = time.perf_counter() - t_sweep
    meta["sweep_s"] = round(sweep, 1)
    if plan.server_startup_s:
        meta["server_startup_s"] = plan.server_startup_s
    meta["machine"]["load_average_end"] = _loadavg()
    meta["wall_time"] = _fmt_s(wall)
    meta["wall_time_s"] = round(wall, 1)
    from peagle.bench.report import build_report, otps_table, targets_table, write_all

    report = build_report(results, meta)
    paths = write_all(report, out)
    print(otps_table(report))
    print()
    print(targets_table(report))
    print(f"\npeagle bench: done in {_fmt_s(wall)}; the sweep itself took {_fmt_s(sweep)}" +
          (f" (estimated {_fmt_s(estimate)})" if estimate else "") + f"; table {paths['markdown']}, JSON {paths['json']}, plots in {out}", file=log, flush=True)
    return 0


def _save_partial(results: list[RunMetrics], meta: dict, out: Path) -> None:
    (out / "partial.json").write_text(json.dumps({"meta": meta, "runs": [r.as_dict() for r in results]}, indent=1))


def _progress_bar(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="bench", file=sys.stderr, disable=disable, dynamic_ncols=True,
                smoothing=0.1)


def _run_config(args, plan: Plan, cfg: Config, concurrencies: list[int], holder: TargetHolder, hf_holder: dict,
                bar, out: Path):
    """Yield one RunMetrics per concurrency for one configuration."""
    from peagle.bench import loadgen

    def progress(_res):
        bar.update(1)

    warm = plan.prompts[: max(args.warmup, 0)]
    if cfg.method.startswith("transformers"):
        runner = _hf_runner(args, plan, hf_holder)
        lookup = args.prompt_lookup_tokens if cfg.method == "transformers-pld" else None
        if warm:
            runner.run(warm, 1, min(8, args.max_tokens), args.temperature, args.seed, plan.chat, prompt_lookup=lookup)
        for c in concurrencies:
            bar.set_description(f"{cfg.label} c={c}")
            res, dur = runner.run(plan.prompts, c, args.max_tokens, args.temperature,
                                  args.seed if args.temperature > 0 else None, plan.chat, args.ignore_eos,
                                  prompt_lookup=lookup, progress=progress)
            yield summarize(res, dur, cfg.method, cfg.k, c)
        return

    if plan.mode == "offline":
        engine = holder.engine(plan.model_path, cfg, max(plan.concurrencies), plan.max_model_len)
        if warm:
            engine.generate([p.chat_messages() if plan.chat else p.text for p in warm],
                            _params(args, min(8, args.max_tokens)), chat=plan.chat)
        for c in concurrencies:
            bar.set_description(f"{cfg.label} c={c}")
            seed = args.seed if args.temperature > 0 else None
            res, dur = loadgen.run_offline(engine, plan.prompts, c,
                                           lambda i: _params(args, seed=None if seed is None else seed + i),
                                           plan.chat, progress)
            yield summarize(res, dur, cfg.method, cfg.k, c)
        del engine
        gc.collect()
        return

    def http_runs(url: str, method: str, k: int, model_name: str | None):
        if warm:
            res, _ = loadgen.run_http(url, warm, 1, min(8, args.max_tokens), args.temperature, None, plan.chat,
                                      model_name, False, args.api_key)
            bad = [r.error for r in res if not r.ok]
            if bad:
                raise BenchError(f"the server at {url} failed the warm-up request: {bad[0]}")
        for c in concurrencies:
            bar.set_description(f"{config_label(method, k)} c={c}")
            before = loadgen.scrape_spec_metrics(url, args.api_key)
            res, dur = loadgen.run_http(url, plan.prompts, c, args.max_tokens, args.temperature,
                                        args.seed if args.temperature > 0 else None, plan.chat, model_name,
                                        args.ignore_eos, args.api_key, progress)
            acceptance = None
            if method in SPEC_METHODS and not any(r.spec for r in res) and before is not None:
                after = loadgen.scrape_spec_metrics(url, args.api_key)
                acceptance = loadgen.spec_metrics_delta(before, after) if after else None
            yield summarize(res, dur, method, k, c, acceptance)

    if plan.mode == "url":
        try:
            info = loadgen.server_info(args.url, args.api_key)
        except Exception as e:  # noqa: BLE001
            raise BenchError(f"cannot reach {args.url}/v1/models: {e}") from None
        method, k = _server_method(info, args)
        if method in SPEC_METHODS:
            head = (info.get("speculative_config") or {}).get("model")
            plan.heads.setdefault(method, {"path": head, "untrained": bool(head) and is_untrained(head)})
        yield from http_runs(args.url, method, k, info.get("id"))
        return

    spec = cfg.speculative_config()
    server = loadgen.ServerProcess(args.model, json.dumps(spec) if spec else None, max(plan.concurrencies),
                                   out / "logs" / f"{cfg.method}-k{cfg.k}.log", plan.max_model_len,
                                   None if args.dtype == "auto" else args.dtype, args.device, threads=args.threads)
    bar.set_description(f"{cfg.label}: starting server")
    try:
        server.start()
    except loadgen.ServerError as e:
        raise BenchError(str(e)) from None
    plan.server_startup_s[cfg.label] = round(server.startup_s, 1)
    try:
        info = loadgen.server_info(server.url)
        yield from http_runs(server.url, cfg.method, cfg.k, info.get("id"))
    finally:
        server.stop()


def _server_method(info: dict, args) -> tuple[str, int]:
    """What a running server does: from peagle's /v1/models extension, else --methods/--k when they name one."""
    spec = info.get("speculative_config")
    if spec:
        from peagle.config import SpeculativeConfig

        try:
            s = SpeculativeConfig.parse({k: v for k, v in spec.items() if k in SpeculativeConfig.model_fields})
            return s.method_name, s.num_speculative_tokens
        except ValueError:
            pass
    if "speculative_config" in info and info["speculative_config"] is None:
        return "baseline", 0
    methods = [m for m in args.methods.split(",") if m.strip() and not m.startswith("transformers")]
    ks = _int_list(args.k, "--k")
    if len(methods) == 1 and (methods[0] == "baseline" or len(ks) == 1):
        return methods[0], (0 if methods[0] == "baseline" else ks[0])
    return "server", 0
