"""`peagle export`: write a drafter head in the layout vLLM (or speculators) loads, and print the `vllm serve` line
that uses it; write an EAGLE-3 head as the draft GGUF llama.cpp runs, and print the `llama-server` line; or create an
untrained head for a target (`--random-init`).

    peagle export HEAD --format vllm|speculators --out DIR [--target MODEL] [--num-speculative-tokens K]
    peagle export HEAD --format llama.cpp --out DRAFT.gguf [--target TARGET.gguf] [--num-speculative-tokens K]
    peagle export --random-init [--target MODEL] --method peagle|eagle3 [--num-layers N] [--mask-token-id ID] --out DIR
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from peagle import cli_args
from peagle.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from peagle.model.checkpoint import LAYOUTS, MASK_ROW
from peagle.model.loading import EMBEDDED_HUB_ID

LLAMA_CPP = "llama.cpp"  # --format: the draft GGUF llama.cpp's draft-eagle3 runs (one file, not a folder)


class ExportError(ValueError):
    """Bad input to `peagle export`; the message says what to do."""


def register(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("head", nargs="?", default=None,
                        help="the head to export: a folder in any accepted layout (vLLM, speculators, SpecForge) or "
                             "a bundled head name")
    parser.add_argument("--format", default="vllm", choices=[*LAYOUTS, LLAMA_CPP],
                        help="layout to write (default: vllm); llama.cpp: an EAGLE-3 head as the draft GGUF that "
                             "`llama-server --spec-type draft-eagle3` loads")
    parser.add_argument("--out", required=True, help="folder to write config.json + model.safetensors into "
                                                     "(--format llama.cpp: the .gguf file to write)")
    parser.add_argument("--target", default=None,
                        help="the target model (folder or hub id); names the verifier and the `vllm serve` model. "
                             "--format llama.cpp: the target's GGUF file that llama-server runs (its vocabulary is "
                             "copied; default for the bundled heads: the embedded SmolLM2's own GGUF). "
                             "With --random-init: the model to build the head for (default: the embedded SmolLM2)")
    parser.add_argument("--num-speculative-tokens", type=cli_args.positive_int, default=None,
                        help=f"K in the printed speculative config (default: {DEFAULT_NUM_SPECULATIVE_TOKENS})")
    init = parser.add_argument_group("untrained heads (--random-init)")
    init.add_argument("--random-init", action="store_true", help="create an untrained head for --target")
    init.add_argument("--method", default=None, choices=["peagle", "eagle3"], help="head type (default: peagle)")
    init.add_argument("--num-layers", type=cli_args.positive_int, default=1, help="drafter decoder layers (default: 1)")
    init.add_argument("--mask-token-id", type=cli_args.nonnegative_int, default=None,
                      help="P-EAGLE mask token: an id the tokenizer never produces (default: an unused special "
                           "token or embedding row, picked from the tokenizer; 3 for SmolLM2)")
    init.add_argument("--seed", type=cli_args.seed, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.random_init:
            if args.head is not None:
                raise ExportError("give either a HEAD to export or --random-init, not both")
            if args.format == LLAMA_CPP:
                raise ExportError("--random-init writes a head folder: create it with --format vllm, then export "
                                  "that folder with --format llama.cpp")
            out, parallel, target = create_random_head(args)
        else:
            if args.head is None:
                raise ExportError("name the HEAD to export (a head folder), or pass --random-init to create one")
            for flag in ("method", "mask_token_id"):
                if getattr(args, flag) is not None:
                    raise ExportError(f"--{flag.replace('_', '-')} only applies with --random-init")
            if args.format == LLAMA_CPP:
                return export_llama_cpp(args)
            out, parallel, target = export_head(args)
        k = args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
        line = vllm_serve_line(target, out, k, parallel)
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"peagle export: error: {e}", file=sys.stderr)
        return 2
    kind = "P-EAGLE" if parallel else "EAGLE-3"
    print(f"wrote {kind} head ({args.format} layout) to {out}; serve it with vLLM:", file=sys.stderr)
    if target is None:
        print("(the head does not name its target: pass --target MODEL, or replace TARGET_MODEL below)",
              file=sys.stderr)
    print(line)
    return 0


def _check_k(k: int | None) -> None:
    if k is None:
        return
    from peagle.config import SpeculativeConfigError

    try:
        SpeculativeConfig.parse({"num_speculative_tokens": k})
    except SpeculativeConfigError as e:
        raise ExportError(f"--num-speculative-tokens: {e}") from None


def export_head(args) -> tuple[Path, bool, str | None]:
    import torch

    from peagle.model.checkpoint import load_head, save_head
    from peagle.model.heads import resolve_head

    _check_k(args.num_speculative_tokens)
    src = resolve_head(args.head)
    raw = json.loads((src / "config.json").read_text())
    verifier = (((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"))
    if verifier is None and _is_bundled(src):
        verifier = EMBEDDED_HUB_ID  # the bundled heads are for the embedded SmolLM2
    target = _target_name(args.target) if args.target else verifier
    has_embed = _has_tensor(src, "embed_tokens.weight")
    embeddings = None
    compact = _has_tensor(src, MASK_ROW)
    if compact or (not has_embed and args.format == "speculators"):
        # A compact P-EAGLE head (the bundled ones) keeps only its learned mask row, and an EAGLE-3 head shares the
        # target's table; vLLM wants P-EAGLE's whole table and speculators every head's (it loads a missing one
        # as zeros), so the target's is written, with the learned row in it.
        what = "stores only its mask-token row" if compact else "has no embedding table"
        if not (args.target or verifier):
            raise ExportError(f"{src} {what} and does not name its target: pass --target MODEL so the full "
                              f"embedding table {args.format} needs can be written")
        from peagle.model.loading import resolve_model

        embeddings = target_embeddings(resolve_model(args.target or verifier))
        has_embed = True
    elif not has_embed:
        # An EAGLE-3 head that shares the target's embeddings: carry a placeholder, write none.
        layer = {**(raw.get("transformer_layer_config") or {}), **raw}
        embeddings = torch.zeros(layer["vocab_size"], layer["hidden_size"])
    dtype = _saved_dtype(src)
    head = load_head(src, target_embeddings=embeddings, dtype=dtype)
    out = Path(args.out).expanduser().resolve()
    save_head(head, out, layout=args.format, verifier=target, include_embeddings=has_embed, dtype=dtype,
              num_speculative_tokens=args.num_speculative_tokens,
              verifier_architectures=_architectures(args.target) if args.target else None)
    return out, head.config.parallel_capable, target


def export_llama_cpp(args) -> int:
    """Write the head as llama.cpp's EAGLE-3 draft GGUF and print the `llama-server` line that runs it."""
    out, target = write_llama_cpp_draft(args)
    k = args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
    print(f"wrote EAGLE-3 draft GGUF to {out}; run it with llama.cpp:", file=sys.stderr)
    print(llama_server_line(target, out, k))
    return 0


def write_llama_cpp_draft(args) -> tuple[Path, Path]:
    import torch

    from peagle.model.checkpoint import load_head
    from peagle.model.heads import resolve_head
    from peagle.model.llama_cpp_draft import write_draft_gguf
    from peagle.model.loading import embedded_gguf_path, is_gguf, resolve_model

    _check_k(args.num_speculative_tokens)
    out = Path(args.out).expanduser().resolve()
    if out.suffix.lower() != ".gguf":
        raise ExportError(f"--format llama.cpp writes one file: give --out a path ending in .gguf, not {args.out}")
    src = resolve_head(args.head)
    if args.target is None and not _is_bundled(src):
        raise ExportError("--format llama.cpp copies the target's vocabulary from its GGUF: pass --target TARGET.gguf "
                          "(the file llama-server runs)")
    target = embedded_gguf_path() if args.target is None else resolve_model(args.target)
    if not is_gguf(target):
        raise ExportError(f"--target {args.target} is not a GGUF file; llama.cpp runs the draft beside a GGUF target: "
                          "convert it with llama.cpp's convert_hf_to_gguf.py and pass that file")
    raw = json.loads((src / "config.json").read_text())
    layer = {**(raw.get("transformer_layer_config") or {}), **raw}
    own_embeddings = _has_tensor(src, "embed_tokens.weight") and not _has_tensor(src, MASK_ROW)
    placeholder = None if own_embeddings else torch.zeros(layer["vocab_size"], layer["hidden_size"])
    head = load_head(src, target_embeddings=placeholder, dtype=_saved_dtype(src))
    write_draft_gguf(head, target, out, name=src.name, own_embeddings=own_embeddings)
    return out, target


def llama_server_line(target: Path, draft: Path, k: int) -> str:
    """The `llama-server` command that runs `target` with this draft (greedy drafts of k tokens)."""
    return (f"llama-server -m {shlex.quote(str(target))} -md {shlex.quote(str(draft))} --spec-type draft-eagle3 "
            f"--spec-draft-n-max {k}")


def create_random_head(args) -> tuple[Path, bool, str]:
    from peagle.model.checkpoint import random_head, save_head
    from peagle.model.loading import resolve_model
    from peagle.model.target import TargetConfig

    _check_k(args.num_speculative_tokens)
    method = args.method or "peagle"
    if args.num_layers < 1:
        raise ExportError(f"--num-layers must be at least 1, got {args.num_layers}")
    path = resolve_model(args.target)
    raw = json.loads((path / "config.json").read_text())
    config = TargetConfig.from_hf(raw)  # refuses architectures outside the Llama family, naming the supported ones
    mask_id = None
    if method == "peagle":
        mask_id = args.mask_token_id
        if mask_id is None:
            mask_id = pick_mask_token_id(path, config.vocab_size)
        if not 0 <= mask_id < config.vocab_size:
            raise ExportError(f"--mask-token-id {mask_id} is outside the target's vocabulary (0..{config.vocab_size - 1})")
    elif args.mask_token_id is not None:
        raise ExportError("--mask-token-id only applies to --method peagle (EAGLE-3 heads have no mask token)")
    embeddings = target_embeddings(path)
    head = random_head(config, embeddings, method=method, num_layers=args.num_layers, mask_token_id=mask_id,
                       seed=args.seed, dtype=embeddings.dtype)
    target = _target_name(args.target)
    out = Path(args.out).expanduser().resolve()
    save_head(head, out, layout=args.format, verifier=target, dtype=embeddings.dtype,
              num_speculative_tokens=args.num_speculative_tokens, verifier_architectures=raw.get("architectures"))
    if mask_id is not None:
        print(f"mask token id {mask_id}", file=sys.stderr)
    return out, method == "peagle", target


def vllm_serve_line(target: str | None, head_dir: Path, k: int, parallel: bool) -> str:
    """The `vllm serve` command that serves `target` with this head (vLLM's --speculative-config JSON)."""
    spec = SpeculativeConfig.for_head(str(head_dir), k, parallel_drafting=parallel)
    return f"vllm serve {shlex.quote(target or 'TARGET_MODEL')} --speculative-config {shlex.quote(spec.to_json())}"


def pick_mask_token_id(model_dir: Path, vocab_size: int) -> int:
    """mask_token.choose_mask_token_id with the target's tokenizer; ExportError when it cannot choose."""
    from peagle.model.mask_token import choose_mask_token_id

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - no tokenizer, or one transformers cannot read
        raise ExportError(f"cannot read a tokenizer in {model_dir} to pick a mask token ({type(e).__name__}); pass "
                          "--mask-token-id with an id the tokenizer never produces") from None
    try:
        return choose_mask_token_id(tok, vocab_size)
    except ValueError as e:
        raise ExportError(str(e)) from None


def target_embeddings(path: Path):
    """The target's input embedding matrix, read alone from its safetensors files."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"):
                if name in st.keys():
                    return st.get_tensor(name)
    raise FileNotFoundError(f"no embed_tokens.weight in the safetensors files of {path}")


def _is_bundled(head: Path) -> bool:
    from peagle.model.heads import HEADS_DIR

    return head.resolve().parent == HEADS_DIR


def _target_name(target: str | None) -> str:
    """What `vllm serve` should be given: the hub id for the embedded default, else the name as the user gave it."""
    from peagle.model.loading import is_embedded

    if is_embedded(target):
        return EMBEDDED_HUB_ID
    path = Path(target).expanduser()
    return str(path.resolve()) if path.is_dir() else target


def _architectures(target: str | None) -> list[str] | None:
    from peagle.model.loading import is_embedded

    if is_embedded(target):
        return ["LlamaForCausalLM"]
    cfg = Path(target).expanduser() / "config.json"
    return json.loads(cfg.read_text()).get("architectures") if cfg.exists() else None


def _has_tensor(path: Path, name: str) -> bool:
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            if any(k.removeprefix("model.") == name for k in st.keys()):
                return True
    return False


def _saved_dtype(path: Path):
    """The floating dtype the head was saved in (exports keep it)."""
    import torch
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(t.get_dtype())
                if dt is not None:
                    return dt
    return torch.bfloat16
