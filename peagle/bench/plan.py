"""What a `peagle bench` run measures: the prompts, the configurations (method x K x speculation policy), the
concurrencies and the heads, decided before anything is timed; and the target, tokenizer and engines loaded once
for everything this process runs."""
from __future__ import annotations

import os
import platform
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from peagle.bench.metrics import AUTO_METHODS, METHOD_NAMES, SPEC_METHODS, config_label
from peagle.config import SpeculativeConfig
from peagle.model.heads import is_untrained

METHODS = ("baseline", "eagle3", "peagle", "ngram", "suffix", "hybrid", "default", "transformers",
           "transformers-pld")
DEFAULT_METHODS = "baseline,eagle3,peagle,transformers,transformers-pld"
ADAPTIVE = "adaptive"
ADAPTIVE_DEFAULT_MAX_K = 7  # the most drafts `--k adaptive` verifies when no fixed K is listed beside it


class BenchError(Exception):
    """A problem the user can fix; printed without a traceback."""


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise BenchError(f"{flag} values must be positive integers, got {text!r}")
    return vals


def parse_k(text: str) -> tuple[list[int], int | None]:
    """--k: fixed Ks, and the largest K of the adaptive policy when `adaptive` is listed (the largest fixed K listed
    beside it, else ADAPTIVE_DEFAULT_MAX_K)."""
    parts = [x.strip().lower() for x in str(text).split(",") if x.strip()]
    adaptive = ADAPTIVE in parts
    fixed = [x for x in parts if x != ADAPTIVE]
    ks = _int_list(",".join(fixed), "--k") if fixed else []
    if not ks and not adaptive:
        raise BenchError(f"--k takes comma-separated integers and/or 'adaptive', got {text!r}")
    return ks, (max(ks, default=ADAPTIVE_DEFAULT_MAX_K) if adaptive else None)


@dataclass
class Config:
    method: str
    k: int = 0  # the K of a fixed policy; the largest K of the adaptive one
    head: str | None = None
    policy: str = "fixed"  # the engine's speculation policy (speculative methods only)
    resolved: SpeculativeConfig | None = None  # method "default": the config resolved for the model

    @property
    def label(self) -> str:
        return config_label(self.method, self.k, self.policy)

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.method == "default":
            return self.resolved
        if self.method in AUTO_METHODS:
            return auto_config(self.method, self.head)
        if self.method not in SPEC_METHODS:
            return None
        return SpeculativeConfig.for_head(self.head, self.k, parallel_drafting=self.method == "peagle")


def auto_config(method: str, head: str | None = None) -> SpeculativeConfig:
    """ngram, suffix or hybrid at its own defaults (the hybrid with the P-EAGLE head `head`)."""
    return SpeculativeConfig(method=method, model=head if method == "hybrid" else None)


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
                        ("--max-model-len", args.max_model_len), ("--quantization", args.quantization),
                        ("--device", args.device),
                        ("--threads", args.threads)):
        if value is not None:
            parts += [flag, str(value)]
    if args.dtype != "auto":
        parts += ["--dtype", args.dtype]
    if not args.enable_prefix_caching:
        parts += ["--no-enable-prefix-caching"]
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

    import transformers

    from peagle.model.kernels import cpu_model

    cpu = cpu_model()

    d = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
         "transformers": transformers.__version__, "python": platform.python_version(),
         "platform": platform.platform(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    d["load_average"] = _loadavg()
    from peagle.model import kernels

    d["kernels"] = kernels.summary("cuda" if d["cuda"] else "cpu")
    from peagle import threads

    d["threads"] = threads.summary()
    d["summary"] = (f"{d['cuda'] or cpu}, {d['cpu_count']} CPU cores, torch {d['torch']} ({d['torch_threads']} "
                    f"threads, {d['threads']['omp_wait']}), transformers {d['transformers']}, "
                    f"Python {d['python']}, {d['kernels']['kernels']} kernels")
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
    ks, adaptive_k = parse_k(args.k)
    methods = _parse_methods(args.methods)
    try:
        prompts = load_dataset(args.dataset, args.num_prompts)
    except DatasetError as e:
        raise BenchError(str(e)) from None
    if any(p.response_format for p in prompts):  # transformers' generate() here takes no output constraint
        dropped = [m for m in methods if m.startswith("transformers")]
        methods = [m for m in methods if not m.startswith("transformers")]
        if not methods:
            raise BenchError(f"--dataset {args.dataset}: its prompts carry output constraints, which "
                             f"{', '.join(dropped)} cannot apply; choose baseline, eagle3 or peagle")
    notes = list(args.note)
    mode = "url" if args.url else "offline" if args.offline else "server"
    model_path = _model_path(args, mode)
    tokenizer = target_holder.tokenizer(model_path) if model_path else None
    chat = _use_chat(args.chat, tokenizer)
    max_model_len = args.max_model_len
    if tokenizer is not None:
        prompts, max_model_len = _fit_prompts(prompts, tokenizer, chat, args.max_tokens, max_model_len, notes)
    if mode == "url":
        configs, heads = _url_configs(args, methods, model_path), {}
    else:
        configs, heads = _local_configs(args, methods, ks, adaptive_k, model_path, target_holder)
    if any(h["untrained"] for h in heads.values()):
        notes.append("heads marked UNTRAINED have random weights: their drafts are almost never accepted "
                     "(acceptance length about 1), so these numbers show only what drafting and verifying cost, "
                     "not what speculation gains")
    return Plan(mode, prompts, concurrencies, configs, chat, max_model_len, model_path, heads, notes)


def _parse_methods(text: str) -> list[str]:
    """--methods: the names and their aliases, in METHODS' order."""
    methods = [m.strip().lower() for m in text.split(",") if m.strip()]
    methods = ["peagle" if m == "p-eagle" else "eagle3" if m in ("eagle-3", "eagle") else
               "baseline" if m in ("none", "no-spec") else m for m in methods]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise BenchError(f"unknown method(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(METHODS)}")
    return [m for m in METHODS if m in methods]


def _model_path(args, mode: str) -> Path | None:
    if mode == "url" and not args.model:  # with --url, a local copy of the model is optional (tokenizer, transformers)
        return None
    from peagle.model.loading import resolve_model

    try:
        return resolve_model(args.model)
    except FileNotFoundError as e:
        if mode != "url":
            raise BenchError(str(e)) from None
        return None


def _use_chat(flag: bool | None, tokenizer) -> bool:
    """--chat / --no-chat, else the chat template when the tokenizer has one (and when there is no tokenizer)."""
    chat = flag
    if chat is None:
        chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None)) if tokenizer else True
    if chat and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise BenchError("--chat: this model's tokenizer has no chat template; use --no-chat")
    return chat


def _fit_prompts(prompts: list, tokenizer, chat: bool, max_tokens: int, max_model_len: int | None,
                 notes: list[str]) -> tuple[list, int]:
    """Without --max-model-len, a context that fits the longest prompt (rounded up to 64); with it, the prompts
    that fit, the others left out with a note."""
    lengths = [len(_encode(tokenizer, p, chat)) for p in prompts]
    if max_model_len is None:
        need = max(lengths) + max_tokens + 8
        return prompts, -(-need // 64) * 64
    keep = [p for p, n in zip(prompts, lengths) if n + max_tokens <= max_model_len]
    if len(keep) < len(prompts):
        notes.append(f"{len(prompts) - len(keep)} prompt(s) longer than --max-model-len {max_model_len} "
                     f"minus --max-tokens were left out")
    if not keep:
        raise BenchError(f"no prompt fits --max-model-len {max_model_len} with --max-tokens {max_tokens}")
    return keep, max_model_len


def _url_configs(args, methods: list[str], model_path: Path | None) -> list[Config]:
    configs = [Config("server")]  # resolved from the server at run time
    local = [m for m in methods if m.startswith("transformers") and args.methods != DEFAULT_METHODS]
    if local and model_path is not None:
        configs += [Config(m) for m in local]
    return configs


def _local_configs(args, methods: list[str], ks: list[int], adaptive_k: int | None, model_path: Path | None,
                   target_holder: "TargetHolder") -> tuple[list[Config], dict]:
    """Each method at each fixed K and the adaptive policy, with the head each speculative method resolved to."""
    configs: list[Config] = []
    heads: dict = {}
    for m in methods:
        if m in SPEC_METHODS:
            path, untrained = _resolve_head(args, m, model_path, target_holder, Path(args.out))
            heads[m] = {"path": str(path), "untrained": untrained}
            configs += [Config(m, k, str(path)) for k in ks]
            if adaptive_k is not None:
                configs.append(Config(m, adaptive_k, str(path), ADAPTIVE))
        elif m in AUTO_METHODS:  # always adaptive: the policy cuts each long model-free draft to what pays
            head = None
            if m == "hybrid":
                path, untrained = _resolve_head(args, "peagle", model_path, target_holder, Path(args.out))
                heads.setdefault("peagle", {"path": str(path), "untrained": untrained})
                head = str(path)
            configs.append(Config(m, auto_config(m, head).max_draft_tokens, head, ADAPTIVE))
        elif m == "default":
            configs.append(_default_config(args))
        else:
            configs.append(Config(m))
    return configs, heads


def _default_config(args) -> Config:
    """What `peagle serve` runs for the model when no config is given, resolved as it resolves it."""
    from peagle.config import SpeculativeConfigError
    from peagle.model.speculation import resolve_speculation

    try:
        chosen = resolve_speculation(args.model, policy=ADAPTIVE)
    except (SpeculativeConfigError, FileNotFoundError) as e:
        raise BenchError(f"default: {e}") from None
    head = str(chosen.head_path) if chosen.head_path is not None else None
    return Config("default", chosen.num_speculative_tokens, head, ADAPTIVE, chosen.config)


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
    head = random_head(target.config, target.input_embeddings(), method=method, mask_token_id=mask_id, seed=0)
    save_head(head, dest)
    return dest


class TargetHolder:
    """Loads the target and tokenizer once for everything done in this process (heads, offline engines)."""

    def __init__(self, dtype: str = "auto", device: str | None = None, quantization: str | None = None,
                 enable_prefix_caching: bool = True):
        self.dtype, self.device, self.quantization = dtype, device, quantization
        self.enable_prefix_caching = enable_prefix_caching
        self._target = self._tok = None

    def tokenizer(self, model_path: Path):
        if self._tok is None:
            from peagle.model.loading import load_tokenizer

            self._tok = load_tokenizer(Path(model_path))
        return self._tok

    def target(self, model_path: Path):
        if self._target is None:
            import torch

            from peagle.model.loading import torch_dtype
            from peagle.model.target import TargetModel

            from peagle.model.loading import is_gguf

            quantized = is_gguf(model_path) or self.quantization
            device = self.device or ("cuda" if torch.cuda.is_available() and not quantized else "cpu")
            self._target = TargetModel.from_pretrained(model_path, dtype=torch_dtype(self.dtype), device=device,
                                                       quantization=self.quantization)
        return self._target

    def engine(self, model_path: Path, cfg: Config, max_num_seqs: int, max_model_len: int | None):
        from peagle.engine.engine import LLMEngine
        from peagle.model.loading import torch_dtype
        from peagle.model.checkpoint import load_head
        from peagle.model.quant import drafter_quantization

        target = self.target(model_path)
        tok = self.tokenizer(model_path)
        spec, drafter = cfg.speculative_config(), None
        if spec is not None and spec.uses_head:
            drafter = load_head(cfg.head, target_embeddings=target.embed_tokens, dtype=torch_dtype(self.dtype),
                                device=target.device).pack_(drafter_quantization(spec.quantization, target.quantized))
            # (as `peagle serve` loads it)
        return LLMEngine(target, tok, drafter, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         model_name=Path(model_path).name, speculation_policy=cfg.policy,
                         enable_prefix_caching=self.enable_prefix_caching)


