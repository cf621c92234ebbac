"""`peagle serve [MODEL]`: the OpenAI- and SageMaker-compatible server.

Flags follow `vllm serve`. Every flag can also come from the environment as `SM_VLLM_<NAME>` (upper case,
dashes as underscores: `SM_VLLM_SPECULATIVE_CONFIG`, `SM_VLLM_MAX_NUM_SEQS`, `SM_VLLM_SAGEMAKER=true`, and
`SM_VLLM_MODEL` for the model), the way SageMaker's vLLM containers map them; a flag on the command line wins.

MODEL is a model folder, a .gguf file, a locally cached Hugging Face id, a preset name from `peagle models`, or
nothing for the embedded SmolLM2-135M-Instruct. Without --speculative-config every model speculates
(peagle/model/speculation.py says how the config is chosen, once); "none" turns it off.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from peagle import cli_args
from peagle.config import SPECULATIVE_CONFIG_ENV, Speculation

if TYPE_CHECKING:
    from peagle.serve.catalog import Preset


ENV_PREFIX = "SM_VLLM_"
SAGEMAKER_PORT = 8080
# Where SageMaker mounts the model and extra model data (heads); overridable for tests.
ML_ROOT_ENV = "PEAGLE_SAGEMAKER_ML_ROOT"


def ml_root() -> Path:
    return Path(os.environ.get(ML_ROOT_ENV, "/opt/ml"))


def register(name: str, parser: argparse.ArgumentParser) -> None:
    add_serve_args(parser)
    parser.set_defaults(func=run)
    apply_env_defaults(parser)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help="model folder, cached Hugging Face id or preset name (default: the embedded SmolLM2)")
    parser.add_argument("--model", help="the same as MODEL (for SM_VLLM_MODEL)")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 with --sagemaker)")
    parser.add_argument("--port", type=cli_args.port, help=f"port (default 8000; {SAGEMAKER_PORT} with --sagemaker)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help='vLLM\'s speculative config, e.g. \'{"method": "eagle3", "model": HEAD, '
                             '"num_speculative_tokens": 7, "parallel_drafting": true}\', \'{"method": "suffix"}\' or '
                             '\'{"method": "ngram", "prompt_lookup_max": 4}\' (methods: peagle, eagle3, ngram, suffix, '
                             'hybrid; default: the hybrid with the bundled head for the embedded weights in any '
                             'format, suffix drafts for any other model); "none" turns speculation off')
    from peagle.engine.policy import DEFAULT_POLICY, POLICIES

    parser.add_argument("--speculation-policy", choices=POLICIES, default=DEFAULT_POLICY,
                        help="adaptive (default): num_speculative_tokens is the most a step verifies, and every step "
                             "picks K from 0 up to it for the most tokens/s; fixed: always K, as vLLM does")
    parser.add_argument("--max-model-len", type=cli_args.positive_int,
                        help="context length (prompt + output) per request")
    parser.add_argument("--max-num-seqs", type=cli_args.positive_int, help="requests decoded together (default 8)")
    add_prefill_args(parser)
    parser.add_argument("--served-model-name", nargs="+", help="name(s) clients use in \"model\"")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16, float16 or float32")
    from peagle.model.quant import QUANTIZATION_HELP, QUANTIZATIONS

    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help=QUANTIZATION_HELP)
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    from peagle.threads import add_threads_arg

    add_threads_arg(parser)
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (as vLLM does) and on "
                                          "/invocations unless --sagemaker (SageMaker authenticates its callers); "
                                          "health checks and /metrics stay open")
    parser.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                        help="origins whose web pages may call this server (CORS, as vLLM's flag; `*` for any); "
                             "by default none: browsers refuse cross-origin calls")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="with --api-key: require the key on /metrics too")
    parser.add_argument("--max-request-bytes", type=cli_args.positive_int, default=4 * 1024 * 1024,
                        help="larger request bodies get 413 (default 4 MiB)")
    parser.add_argument("--body-timeout", type=cli_args.positive_float, default=30.0,
                        help="seconds a client has to send a request body once its headers are in; a slower one "
                             "gets 408 and is disconnected (default 30)")
    parser.add_argument("--timeout-keep-alive", type=cli_args.positive_float, default=30.0,
                        help="seconds an idle keep-alive connection stays open (default 30)")
    parser.add_argument("--max-connections", type=cli_args.positive_int, default=512,
                        help="concurrent connections (and requests) served; more get 503 at once (default 512)")
    parser.add_argument("--max-waiting", type=cli_args.nonnegative_int, default=256,
                        help="requests allowed to wait for a slot before new ones get 503 (default 256)")
    parser.add_argument("--drain-timeout", type=cli_args.nonnegative_float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                             "(default 30)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="do not keep a no-speculation engine for \"speculation\": false requests")
    parser.add_argument("--baseline-max-num-seqs", type=cli_args.positive_int, default=2,
                        help="slots of the no-speculation engine (default 2)")
    parser.add_argument("--recalibrate", action="store_true",
                        help="time the start-up forwards again instead of taking those remembered from the last "
                             "start with the same model shapes, formats, kernels, threads and CPU "
                             "($PEAGLE_HOME/calibration)")
    parser.add_argument("--sagemaker", action="store_true",
                        help="SageMaker container contract: 0.0.0.0:8080, model from /opt/ml/model, heads from "
                             "/opt/ml/additional-model-data-sources/<channel>")
    parser.add_argument("--engine", choices=["peagle", "vllm"], default="peagle",
                        help="vllm: exec `vllm serve` with the same model and speculative config")
    parser.add_argument("--dry-run", action="store_true", help="with --engine vllm: print the command only")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")


def add_prefill_args(parser: argparse.ArgumentParser) -> None:
    """The engine's prefix cache and chunked prefill, as vLLM names them (engine_options turns them into kwargs)."""
    from peagle.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from peagle.engine.kv_memory import DEFAULT_KV_MEMORY_FRACTION
    from peagle.engine.prefix_cache import DEFAULT_MEMORY_GB
    from peagle.engine.step_budget import DEFAULT_STEP_TIME_MULTIPLE

    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the computed blocks of earlier requests (prompts and answers) for prompts that "
                             "start the same way, bit-exactly (default: on)")
    parser.add_argument("--prefix-cache-gb", type=cli_args.positive_float, default=DEFAULT_MEMORY_GB,
                        help=f"memory for cached blocks, least recently used evicted first (default {DEFAULT_MEMORY_GB})")
    parser.add_argument("--kv-cache-gb", type=cli_args.positive_float, default=None,
                        help="the most memory the paged KV cache may take; requests wait for blocks beyond it, and "
                             "the newest running request is preempted and computed again when the others outgrow "
                             f"it (default: {DEFAULT_KV_MEMORY_FRACTION:.0%} of the memory available at start; "
                             "memory is committed only as tokens arrive; the no-speculation engine beside it has "
                             "its own)")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill long prompts in chunks between decode steps, so running streams keep flowing "
                             "(default: on)")
    parser.add_argument("--max-num-batched-tokens", type=cli_args.positive_int,
                        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"prompt tokens prefilled per engine step, at most (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--max-step-time-ms", type=cli_args.positive_float, default=None,
                        help="while streams decode, size each step's prefill work so the step costs at most this "
                             f"(default: {DEFAULT_STEP_TIME_MULTIPLE} plain decode steps, measured at start-up)")


def _env_name(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs:
        return None
    return ENV_PREFIX + longs[0][2:].replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ=None) -> None:
    """Make SM_VLLM_<NAME> the default of --<name>; the command line still wins."""
    environ = os.environ if environ is None else environ
    defaults = {}
    for action in parser._actions:
        env = _env_name(action)
        if env is None or env not in environ or action.dest == "help":
            continue
        raw = environ[env]
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            value = raw.strip().lower() in ("1", "true", "yes", "on")
        elif action.nargs in ("+", "*"):
            value = shlex.split(raw)
        else:
            try:
                value = action.type(raw) if action.type else raw
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                why = f" ({e})" if isinstance(e, argparse.ArgumentTypeError) else ""
                parser.error(f"{env}={raw!r} is not a valid value for {action.option_strings[0]}{why}")
            if action.choices and value not in action.choices:
                parser.error(f"{env}={raw!r}: choose one of {', '.join(map(str, action.choices))}")
        defaults[action.dest] = value
    parser.set_defaults(**defaults)


class ServeError(Exception):
    """A start-up problem the user can fix; printed without a traceback."""


def _fail(msg: str, code: int = 2) -> int:
    print(f"peagle serve: error: {msg}", file=sys.stderr, flush=True)
    return code


# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServePlan:
    """What `peagle serve` serves, decided before anything heavy loads."""
    speculation: Speculation  # the target, its head and policy, resolved once; the engine loads them as they are
    preset: "Preset | None"  # the preset the model name chose, if any
    host: str
    port: int
    served: tuple[str, ...]  # the names clients use in "model"
    notes: tuple[str, ...] = ()  # printed at start-up


def resolve(args) -> ServePlan:
    """Turn arguments into what to serve: the speculation (model, head, config, policy: resolved here, once),
    preset, names, address. Raises ServeError."""
    from peagle.config import SpeculativeConfigError
    from peagle.model.loading import EMBEDDED_MODEL
    from peagle.model.speculation import resolve_speculation
    from peagle.serve import catalog

    name = args.model_tag or args.model
    if args.sagemaker and name is None and (ml_root() / "model" / "config.json").exists():
        name = str(ml_root() / "model")
    preset = catalog.find(name) if name is not None and not Path(name).expanduser().exists() else None
    if preset is not None and preset.engine == "vllm" and args.engine != "vllm":
        raise ServeError(f"preset {preset.name} ({preset.model}) is a large GPU model that peagle's engine does not "
                         f"run; serve it with vLLM: `peagle serve {preset.name} --engine vllm`")
    try:
        speculation = resolve_speculation(
            preset.model if preset else name, args.speculative_config,
            source=_speculative_config_source(args.speculative_config),
            preset=preset.speculative_config if preset and preset.model is not None else None,
            channels=ml_root() / "additional-model-data-sources" if args.sagemaker else None,
            policy=args.speculation_policy, local=args.engine == "peagle")
    except (SpeculativeConfigError, FileNotFoundError) as e:
        raise ServeError(str(e)) from None
    notes = [f"note: {speculation.note}"] if speculation.note else []
    if speculation.origin == "preset" and not preset.verified:
        notes.append(f"warning: preset {preset.name}'s head id {preset.head!r} is unverified ({preset.notes})")
    host = args.host or ("0.0.0.0" if args.sagemaker else "127.0.0.1")
    port = args.port or (SAGEMAKER_PORT if args.sagemaker else 8000)
    served = tuple(args.served_model_name or [preset.name if preset else (name or EMBEDDED_MODEL)])
    return ServePlan(speculation, preset, host, port, served, tuple(notes))


def _speculative_config_source(text: str | None) -> str:
    """Where --speculative-config's value came from, to name it in errors: the environment when apply_env_defaults
    put it there (the variable holds it and the command line does not give the flag), else the flag."""
    flag = "--speculative-config"
    on_command_line = any(a == flag or a.startswith(flag + "=") for a in sys.argv)
    from_env = text is not None and text == os.environ.get(SPECULATIVE_CONFIG_ENV) and not on_command_line
    return SPECULATIVE_CONFIG_ENV if from_env else flag


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    try:
        plan = resolve(args)
    except ServeError as e:
        return _fail(str(e))
    for n in plan.notes:
        print(f"peagle serve: {n}", file=sys.stderr, flush=True)
    if args.engine == "vllm":
        return exec_vllm(args, plan)
    return serve(args, plan)


def engine_options(args) -> dict:
    """The engine's prefill options from serve's flags, and where its start-up timings are remembered."""
    from peagle.model.loading import peagle_home

    return {"enable_prefix_caching": args.enable_prefix_caching, "prefix_cache_gb": args.prefix_cache_gb,
            "kv_cache_gb": args.kv_cache_gb, "enable_chunked_prefill": args.enable_chunked_prefill,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_step_time_ms": args.max_step_time_ms,
            "calibration_dir": peagle_home() / "calibration"}


def build_server(args, plan):
    """Load the engine(s) and build the app; returns (app, async engine)."""
    from peagle.config import SpeculativeConfigError
    from peagle.engine import LLMEngine
    from peagle.serve.app import build_app
    from peagle.serve.async_engine import AsyncEngine
    from peagle.serve.metrics import Metrics
    from peagle.threads import apply_threads_arg

    apply_threads_arg(args)
    if args.recalibrate:
        shutil.rmtree(engine_options(args)["calibration_dir"], ignore_errors=True)
    try:
        engine = LLMEngine.from_pretrained(plan.speculation, max_num_seqs=args.max_num_seqs or 8,
                                           max_model_len=args.max_model_len, device=args.device, dtype=args.dtype,
                                           quantization=args.quantization, **engine_options(args))
    except (SpeculativeConfigError, FileNotFoundError, ValueError) as e:
        raise ServeError(str(e)) from None
    baseline = None
    if engine.spec is not None and not args.no_baseline:
        baseline = LLMEngine(engine.target, engine.tokenizer, None, None, max_num_seqs=args.baseline_max_num_seqs,
                             max_model_len=engine.max_model_len, model_name=engine.model_name,
                             # it serves only "speculation": false requests: a quarter of the caches' memory
                             **{**engine_options(args), "prefix_cache_gb": args.prefix_cache_gb / 4})
    metrics = Metrics(plan.served[0], engine.k, speculation=plan.speculation)
    metrics.show_cache(engine)
    aengine = AsyncEngine(engine, baseline, max_waiting=args.max_waiting, metrics=metrics)
    model = plan.speculation.model
    app = build_app(aengine, list(plan.served), api_key=args.api_key, model_path=model or engine.model_name,
                    speculation=plan.speculation,
                    drain_timeout=args.drain_timeout, max_body_bytes=args.max_request_bytes,
                    protect_metrics=args.protect_metrics, sagemaker=args.sagemaker,
                    allowed_origins=args.allowed_origins, body_timeout=args.body_timeout)
    return app, aengine


def serve(args, plan) -> int:
    import asyncio

    import uvicorn

    from peagle.serve.idle_gc import IdleCollector

    try:
        app, aengine = build_server(args, plan)
    except ServeError as e:
        return _fail(str(e))
    engine = aengine.engine
    url = f"http://{'127.0.0.1' if plan.host in ('0.0.0.0', '::') else plan.host}:{plan.port}"
    from peagle import threads

    print(f"peagle serve: {', '.join(plan.served)} with {plan.speculation.describe()}, max_model_len "
          f"{engine.max_model_len}, max_num_seqs {engine.max_num_seqs}, {threads.describe()}", file=sys.stderr,
          flush=True)
    print(f"peagle serve: listening on http://{plan.host}:{plan.port}  (playground: {url}/)", file=sys.stderr,
          flush=True)

    class Server(uvicorn.Server):
        """The first SIGTERM/SIGINT drains while still listening (new requests get 503, in-flight ones finish or
        are aborted at the deadline and end their streams cleanly), then shuts uvicorn down; a second one stops
        at once."""

        def handle_exit(self, sig, frame):
            if aengine.draining or aengine.loop is None:
                return super().handle_exit(sig, frame)
            aengine.draining = True  # refuse new work at once
            aengine.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain_then_exit()))

        async def drain_then_exit(self):
            await app.state.peagle.drain()
            self.should_exit = True

    # Streams have ended by the time uvicorn shuts down; what is left is idle connections.
    config = uvicorn.Config(app, host=plan.host, port=plan.port, log_level=args.log_level,
                            access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=5,
                            timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.max_connections)
    server = Server(config)
    # full collections from here on, the start-up freeze included: on the engine thread between steps, once listening
    aengine.collector = IdleCollector().take_over()
    server.run()
    return 0 if server.started else 1


# ------------------------------------------------------------------------------------------------------------
# --engine vllm


def vllm_command(args, plan: ServePlan) -> list[str]:
    from peagle.model.loading import is_embedded

    chosen = plan.speculation
    model = chosen.model_path if is_embedded(chosen.model) else chosen.model
    cmd = ["vllm", "serve", str(model)]
    # peagle's model-free default is not vLLM's (its suffix method needs another package): vLLM gets a config
    # only where one was asked for or a head drafts
    if chosen.config is not None and (chosen.origin != "default" or chosen.config.uses_head):
        cmd += ["--speculative-config", chosen.config.for_vllm().to_json()]
    cmd += ["--host", plan.host, "--port", str(plan.port)]
    preset_args = list(plan.preset.vllm_args) if plan.preset is not None else []
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
        preset_args = _drop_flag(preset_args, "--max-model-len")
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        preset_args = _drop_flag(preset_args, "--max-num-seqs")
    cmd += preset_args
    if args.served_model_name:
        cmd += ["--served-model-name", *args.served_model_name]
    if args.dtype and args.dtype != "auto":
        cmd += ["--dtype", args.dtype]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        out.append(a)
    return out


def exec_vllm(args, plan) -> int:
    cmd = vllm_command(args, plan)
    shown = " ".join(shlex.quote(c) for c in cmd)
    if args.dry_run:
        print(shown)
        return 0
    if importlib.util.find_spec("vllm") is None or shutil.which("vllm") is None:
        return _fail("--engine vllm needs vLLM (0.16 or newer, for parallel drafting) on a machine with a CUDA GPU: "
                     "`pip install 'vllm>=0.16'`. The command it would run:\n  " + shown, 1)
    print(f"peagle serve: exec {shown}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
    return 1  # not reached
