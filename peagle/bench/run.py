"""Running a `peagle bench` plan: every configuration at every concurrency, one after another (a `peagle serve`
subprocess per configuration, a running server, or engines in this process), with a progress bar over requests
(its rate gives the time left); then the report."""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from peagle.bench import loadgen
from peagle.bench.datasets import BenchPrompt
from peagle.bench.metrics import DRAFTING_METHODS, SPEC_METHODS, RequestResult, RunMetrics, config_label, summarize
from peagle.bench.plan import (BenchError, Config, Plan, TargetHolder, _loadavg, canonical_command, machine,
                               make_plan, parse_k)
from peagle.model.heads import is_untrained


def _params(args, max_tokens: int | None = None, seed: int | None = None, ignore_eos: bool | None = None):
    from peagle.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=args.temperature,
                          seed=seed, ignore_eos=args.ignore_eos if ignore_eos is None else ignore_eos)



def _hf_runner(args, plan: Plan, hf_holder: dict):
    if "runner" not in hf_holder:
        from peagle.bench.loadgen import HFRunner
        from peagle.model.loading import torch_dtype

        device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
        hf_holder["runner"] = HFRunner(plan.model_path, dtype=torch_dtype(args.dtype), device=device)
    return hf_holder["runner"]


def _fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


def sweep(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from peagle.threads import apply_threads_arg

    apply_threads_arg(args)
    started = _dt.datetime.now().astimezone()
    t_start = time.perf_counter()
    holder = TargetHolder(args.dtype, args.device, args.quantization, args.enable_prefix_caching)
    plan = make_plan(args, holder)
    runs_planned = [(cfg, c) for cfg in plan.configs for c in plan.concurrencies_for(cfg)]
    print(f"peagle bench: {len(plan.configs)} configuration(s) x concurrency {plan.concurrencies} = "
          f"{len(runs_planned)} runs of {len(plan.prompts)} {args.dataset} prompts, up to {args.max_tokens} tokens "
          f"each ({plan.mode} mode{', chat template' if plan.chat else ''})", file=sys.stderr, flush=True)
    for note in plan.notes:
        print(f"peagle bench: note: {note}", file=sys.stderr, flush=True)

    t_sweep = time.perf_counter()
    bar = _progress_bar(len(plan.prompts) * len(runs_planned), args.no_progress)
    meta = _meta(args, plan, started)
    try:
        results = _measure_all(args, plan, holder, bar, meta, out)
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
    print(f"\npeagle bench: done in {_fmt_s(wall)}; the sweep itself took {_fmt_s(sweep)}; table "
          f"{paths['markdown']}, JSON {paths['json']}, plots in {out}", file=sys.stderr, flush=True)
    return 0


def _meta(args, plan: Plan, started: _dt.datetime) -> dict:
    """What the report says about the run: its command, prompts, sampling, model, heads and machine."""
    return {"command": canonical_command(args), "dataset": args.dataset, "num_prompts": len(plan.prompts),
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "seed": args.seed, "chat": plan.chat, "mode": plan.mode, "concurrency": plan.concurrencies,
            "model": str(args.model or (f"served at {args.url}" if args.url else
                                        f"embedded SmolLM2-135M-Instruct ({plan.model_path})")),
            "weights": _weights(args, plan), "max_model_len": plan.max_model_len, "heads": plan.heads,
            "notes": plan.notes,
            "started": started.isoformat(timespec="seconds"), "machine": machine()}


def _measure_all(args, plan: Plan, holder: TargetHolder, bar, meta: dict, out: Path) -> list[RunMetrics]:
    """Every configuration at each of its concurrencies, saving partial results after each run."""
    hf_holder: dict = {}
    results: list[RunMetrics] = []
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
            print(f"\npeagle bench: {cfg.label} failed, skipping it: {e}", file=sys.stderr, flush=True)
            bar.update(len(plan.prompts) * len(cs) - sum(1 for r in results if r.label == cfg.label) *
                       len(plan.prompts))
    return results


def _save_partial(results: list[RunMetrics], meta: dict, out: Path) -> None:
    (out / "partial.json").write_text(json.dumps({"meta": meta, "runs": [r.as_dict() for r in results]}, indent=1))


def _progress_bar(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="bench", file=sys.stderr, disable=disable, dynamic_ncols=True,
                smoothing=0.1)


def _weights(args, plan) -> str | None:
    """The target's weight format: a .gguf file's own blocks, --quantization, or the float dtype."""
    from peagle.model.loading import is_gguf

    if args.url:
        return None  # the server's /v1/models says (its "kernels" card)
    if plan.model_path is not None and is_gguf(plan.model_path):
        return f"gguf ({Path(plan.model_path).name})"
    return args.quantization or ("bf16" if args.dtype == "auto" else args.dtype)


@dataclass
class _ConfigRuns:
    """What measuring one configuration at each of its concurrencies needs, whichever way it runs."""
    args: argparse.Namespace
    plan: Plan
    cfg: Config
    concurrencies: list[int]
    bar: Any  # the sweep's progress bar, one step per request
    salt_base: str = field(default_factory=lambda: secrets.token_hex(6))

    @property
    def warm(self) -> list[BenchPrompt]:
        return self.plan.prompts[: max(self.args.warmup, 0)]

    def cache_salt(self, run: str) -> str:
        """Each run's own cache_salt (the warm-up's, each concurrency's): the prefix cache and the suffix trees
        reuse nothing a previous run left, so no run replays answers an earlier one cached, and every concurrency
        starts from the same empty caches (each run's own repeats, such as a shared system prompt, still hit)."""
        return f"peagle-bench-{self.salt_base}-{run}"

    @property
    def seed(self) -> int | None:
        """The requests' base seed: only sampling takes one."""
        return self.args.seed if self.args.temperature > 0 else None

    def progress(self, _result: RequestResult) -> None:
        self.bar.update(1)

    def starting(self, label: str, concurrency: int) -> None:
        self.bar.set_description(f"{label} c={concurrency}")


def _run_config(args, plan: Plan, cfg: Config, concurrencies: list[int], holder: TargetHolder, hf_holder: dict,
                bar, out: Path) -> Iterator[RunMetrics]:
    """Yield one RunMetrics per concurrency for one configuration: transformers' generate(), an engine in this
    process, the running server at --url, or a `peagle serve` started for the configuration."""
    runs = _ConfigRuns(args, plan, cfg, concurrencies, bar)
    if cfg.method.startswith("transformers"):
        yield from _transformers_runs(runs, _hf_runner(args, plan, hf_holder))
    elif plan.mode == "offline":
        yield from _offline_runs(runs, holder)
    elif plan.mode == "url":
        yield from _url_runs(runs)
    else:
        yield from _served_runs(runs, out)


def _transformers_runs(runs: _ConfigRuns, runner) -> Iterator[RunMetrics]:
    args, plan, cfg = runs.args, runs.plan, runs.cfg
    lookup = args.prompt_lookup_tokens if cfg.method == "transformers-pld" else None
    if runs.warm:
        runner.run(runs.warm, 1, min(8, args.max_tokens), args.temperature, args.seed, plan.chat, prompt_lookup=lookup)
    for c in runs.concurrencies:
        runs.starting(cfg.label, c)
        cpu = time.process_time()
        res, dur = runner.run(plan.prompts, c, args.max_tokens, args.temperature, runs.seed, plan.chat,
                              args.ignore_eos, prompt_lookup=lookup, progress=runs.progress)
        yield summarize(res, dur, cfg.method, cfg.k, c, cpu_s=time.process_time() - cpu)


def _offline_runs(runs: _ConfigRuns, holder: TargetHolder) -> Iterator[RunMetrics]:
    args, plan, cfg = runs.args, runs.plan, runs.cfg
    engine = holder.engine(plan.model_path, cfg, max(plan.concurrencies), plan.max_model_len)
    if runs.warm:
        engine.generate([p.chat_messages() if plan.chat else p.text for p in runs.warm],
                        _params(args, min(8, args.max_tokens)), chat=plan.chat, cache_salt=runs.cache_salt("warm-up"))
    seed = runs.seed
    for c in runs.concurrencies:
        runs.starting(cfg.label, c)
        cpu = time.process_time()  # the engine runs in this process
        res, dur = loadgen.run_offline(engine, plan.prompts, c,
                                       lambda i: _params(args, seed=None if seed is None else seed + i),
                                       plan.chat, runs.progress, cache_salt=runs.cache_salt(f"c{c}"))
        yield summarize(res, dur, cfg.method, cfg.k, c, policy=cfg.policy, cpu_s=time.process_time() - cpu)
    del engine
    gc.collect()


def _url_runs(runs: _ConfigRuns) -> Iterator[RunMetrics]:
    """The server already running at --url, doing whatever it was started with."""
    args = runs.args
    try:
        info = loadgen.server_info(args.url, args.api_key)
    except Exception as e:  # noqa: BLE001
        raise BenchError(f"cannot reach {args.url}/v1/models: {e}") from None
    method, k = _server_method(info, args)
    if method in SPEC_METHODS:
        head = (info.get("speculative_config") or {}).get("model")
        runs.plan.heads.setdefault(method, {"path": head, "untrained": bool(head) and is_untrained(head)})
    yield from _http_runs(runs, args.url, method, k, info.get("id"))


def _served_runs(runs: _ConfigRuns, out: Path) -> Iterator[RunMetrics]:
    """A `peagle serve` subprocess started for this configuration, stopped after its runs."""
    args, plan, cfg = runs.args, runs.plan, runs.cfg
    spec = cfg.speculative_config()
    log = out / "logs" / f"{cfg.method}-k{cfg.k}{'-adaptive' if cfg.policy == 'adaptive' else ''}.log"
    server = loadgen.ServerProcess(args.model, spec.to_json() if spec else None, max(plan.concurrencies), log,
                                   plan.max_model_len, None if args.dtype == "auto" else args.dtype, args.device,
                                   extra_args=(["--speculation-policy", cfg.policy] if spec else [])
                                   + (["--quantization", args.quantization] if args.quantization else [])
                                   + ([] if args.enable_prefix_caching else ["--no-enable-prefix-caching"]),
                                   threads=args.threads)
    runs.bar.set_description(f"{cfg.label}: starting server")
    try:
        server.start()
    except loadgen.ServerError as e:
        raise BenchError(str(e)) from None
    plan.server_startup_s[cfg.label] = round(server.startup_s, 1)
    try:
        info = loadgen.server_info(server.url)
        yield from _http_runs(runs, server.url, cfg.method, cfg.k, info.get("id"), cfg.policy, server)
    finally:
        server.stop()


def _http_runs(runs: _ConfigRuns, url: str, method: str, k: int, model_name: str | None, policy: str = "fixed",
               server: loadgen.ServerProcess | None = None) -> Iterator[RunMetrics]:
    args = runs.args
    settings = loadgen.LoadSettings(max_tokens=args.max_tokens, temperature=args.temperature, seed=runs.seed,
                                    chat=runs.plan.chat, model=model_name, ignore_eos=args.ignore_eos,
                                    api_key=args.api_key)
    if runs.warm:
        warm = replace(settings, max_tokens=min(8, args.max_tokens), seed=None, ignore_eos=False,
                       cache_salt=runs.cache_salt("warm-up"))
        res, _ = loadgen.run_http(url, runs.warm, 1, warm)
        bad = [r.error for r in res if not r.ok]
        if bad:
            raise BenchError(f"the server at {url} failed the warm-up request: {bad[0]}")
    for c in runs.concurrencies:
        runs.starting(config_label(method, k, policy), c)
        before = loadgen.scrape_spec_metrics(url, args.api_key)
        cpu = server.cpu_seconds() if server else None
        res, dur = loadgen.run_http(url, runs.plan.prompts, c, replace(settings, cache_salt=runs.cache_salt(f"c{c}")),
                                    progress=runs.progress)
        acceptance = None
        if method in DRAFTING_METHODS and not any(r.spec for r in res) and before is not None:
            after = loadgen.scrape_spec_metrics(url, args.api_key)
            acceptance = loadgen.spec_metrics_delta(before, after) if after else None
        # A running server's policy is in its responses' stats (peagle's extension); vLLM's is fixed.
        policy = next((r.spec["speculation_policy"] for r in res if (r.spec or {}).get("speculation_policy")),
                      policy)
        cpu_s = server.cpu_seconds() - cpu if cpu is not None else None
        yield summarize(res, dur, method, k, c, acceptance, policy, cpu_s)


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
    ks, _ = parse_k(args.k)
    if len(methods) == 1 and (methods[0] == "baseline" or len(ks) == 1):
        return methods[0], (0 if methods[0] == "baseline" else ks[0])
    return "server", 0

