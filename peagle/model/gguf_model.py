"""Reading a GGUF file (llama.cpp's format) as a target: its block-quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
and the K-quants Q4_K, Q5_K, Q6_K) stay in their blocks, bit for bit (peagle.model.quant runs them), float tensors
become bf16 (under Hugging Face's names and conventions: a family's own tensor names and norm offsets, family.py),
and the tokenizer, chat template and config come from the file's metadata (transformers parses those; peagle keeps
them in a small folder under $PEAGLE_HOME so that later loads skip the parse). The file itself is read by
gguf_file.py.

Any other tensor type (Q2_K, Q3_K, the IQ and ternary types, ...) is refused with its name: peagle never dequantizes
weights behind the user's back.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from peagle.model import gguf_file
from peagle.model.family import family_of

BLOCK_FORMATS = {t: t.lower() for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}  # -> quant
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}
_SKIPPED = {"rope_freqs.weight"}  # llama3 RoPE factors: transformers derives them from the config


def metadata_dir(path: str | Path) -> Path:
    """A folder with the GGUF's config.json and tokenizer (with its chat template), made once per file."""
    from peagle.model.home import file_lock, peagle_home

    path = Path(path).resolve()
    st = path.stat()
    out = peagle_home() / "gguf" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").exists():
            return out
        gguf_file.read_tensors(path)  # a clear error for a bad file before transformers' own
        from transformers import AutoConfig, AutoTokenizer

        print(f"peagle: reading the config and tokenizer of {path.name} (once)...", file=sys.stderr, flush=True)
        t0 = time.time()
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            cfg.pop(key, None)
        _complete_config(cfg, tokenizer)
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tmp.rename(out)
        print(f"peagle: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def _complete_config(cfg: dict, tokenizer) -> None:
    """What a file of a known family leaves out: its family's chat template when the file has none (Gemma 3 270M
    ships without), its end-of-turn tokens among the config's EOS ids (a reply ends there), and the attention scale
    llama.cpp gives it."""
    from peagle.model.family import FAMILIES

    family = FAMILIES.get(cfg.get("model_type"))
    if family is None:
        return  # refused with its name when the model is built
    if family.gguf_query_scalar_is_head_dim:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if not tokenizer.chat_template and family.chat_template:
        tokenizer.chat_template = family.chat_template
    eos = cfg.get("eos_token_id")
    eos = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    vocab = tokenizer.get_vocab()
    cfg["eos_token_id"] = eos + [vocab[t] for t in family.end_of_turn if t in vocab and vocab[t] not in eos]


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for its interleaved RoPE (convert_hf_to_gguf's `permute`), so that
    the rows are in the order of Hugging Face's half-split RoPE, which peagle uses. Works on block rows too."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def read_tensors(path: str | Path, config: dict) -> dict[str, torch.Tensor | tuple[str, torch.Tensor]]:
    """The GGUF's tensors under peagle's (Hugging Face) names: float ones as bf16 tensors, block-quantized ones as
    (format, uint8 blocks [rows, bytes]) exactly as stored."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    arch = gguf_file.read_metadata(path, {"general.architecture"}).get("general.architecture")
    family = family_of(config.get("model_type"))
    layer_names = {**_LAYER_NAMES, **family.gguf_layer_names}
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    out, unsupported = {}, []
    for t in gguf_file.read_tensors(path):
        if t.name in _SKIPPED:
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        name = f"layers.{m.group(1)}.{layer_names.get(m.group(2), m.group(2))}" if m else _TOP_NAMES.get(t.name, t.name)
        kind, shape = t.type_name, list(t.shape)
        if kind in BLOCK_FORMATS:
            block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            if len(shape) != 2 or shape[-1] % block:
                raise ValueError(f"{path}: tensor {t.name} ({kind}, {'x'.join(map(str, shape))}) is not a matrix of "
                                 f"whole {kind} blocks of {block} (a corrupt file: re-quantize it with "
                                 "llama-quantize)")
            value = torch.from_numpy(np.array(t.data).reshape(shape[0], -1))
        elif kind in FLOAT_TYPES:
            dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[kind]
            value = torch.from_numpy(np.array(t.data).view(dtype)).reshape(shape)
            if kind == "BF16":
                value = value.view(torch.bfloat16)
            if family.gguf_norm_shift and t.name.endswith("norm.weight"):  # stored as 1 + w (Gemma)
                value = value.float() - family.gguf_norm_shift
            value = value.to(torch.bfloat16)
        else:
            unsupported.append(f"{t.name} ({kind})")
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            value = _unpermute(value, heads if ".q_proj." in name else kv_heads)
        out[name] = (BLOCK_FORMATS[kind], value) if kind in BLOCK_FORMATS else value
    if unsupported:
        shown = ", ".join(unsupported[:4]) + (f" and {len(unsupported) - 4} more" if len(unsupported) > 4 else "")
        raise ValueError(
            f"{path.name}: peagle's kernels have no {', '.join(sorted({u.split('(')[1][:-1] for u in unsupported}))} "
            f"(tensors {shown}). Supported tensor types: {', '.join(BLOCK_FORMATS)} and {', '.join(FLOAT_TYPES)}; "
            "re-quantize the file with `llama-quantize` to one of those (for example Q4_K_M, or with `--pure` Q8_0), "
            "or pass the original safetensors model with `--quantization q4_0`")
    return out
