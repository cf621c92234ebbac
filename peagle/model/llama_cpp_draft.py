"""An EAGLE-3 head as the draft GGUF that llama.cpp runs (`llama-server --spec-type draft-eagle3 -md draft.gguf`).

llama.cpp's `eagle3` architecture is one decoder layer whose attention reads [norm(embed(token)), hidden_norm(g)]
(2H wide), where g is fc(three target features) on the first step and the layer's own pre-norm output after that;
the features are the residual stream entering the target layers `eagle3.target_layers`, the same ones peagle's
drafter reads. The file holds the layer, fc, the final norm, the draft-vocab lm_head and `d2t` as absolute target
ids; it borrows the target's token embeddings unless the head has its own. Tensor names, dtypes (matrices in the
head's float type, norms F32, d2t I64), the RoPE row order of q/k and the metadata keys are those llama.cpp's
`convert_hf_to_gguf.py --target-model-dir` writes, so llama.cpp loads either file the same way. The vocabulary
(`tokenizer.*`) is copied from the target GGUF the draft will run beside: llama.cpp loads a vocabulary with every
model and maps draft ids into it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ARCH = "eagle3"
_LAYER = {  # peagle / vLLM layer-0 tensor -> llama.cpp's
    "input_layernorm.weight": "attn_norm.weight", "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
        "embed_tokens.weight": "token_embd.weight"}
_FLOAT_TYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_FILE_TYPES = {"BF16": "MOSTLY_BF16", "F16": "MOSTLY_F16", "F32": "ALL_F32"}  # general.file_type: gguf.LlamaFileType


class DraftExportError(ValueError):
    """A head or target that llama.cpp's draft-eagle3 cannot run; the message says why and what to do."""


def rope_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from Hugging Face's half-split RoPE to llama.cpp's interleaved pairs (the
    inverse of peagle.model.gguf_model's unpermute)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def check_runnable(drafter) -> None:
    """Refuse what llama.cpp's eagle3 graph cannot express, naming the reason."""
    c = drafter.config
    if c.parallel_capable:
        raise DraftExportError(
            "this is a P-EAGLE head (it drafts all K tokens in one pass from mask tokens); llama.cpp has no parallel "
            "drafting and runs only EAGLE-3 chain heads: export an EAGLE-3 head (the bundled smollm2-135m-eagle3, "
            "or one trained with `--method eagle3`)")
    if c.num_layers != 1:
        raise DraftExportError(f"the head has {c.num_layers} decoder layers; llama.cpp's eagle3 graph runs exactly one")
    if len(c.feature_layer_ids) != 3:
        raise DraftExportError(f"the head reads {len(c.feature_layer_ids)} target layers; llama.cpp's eagle3 reads 3")
    rope_type = c.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise DraftExportError(f"RoPE type {rope_type!r}: write this head with `peagle export --format vllm` and convert "
                               "it with llama.cpp's `convert_hf_to_gguf.py --target-model-dir`, which handles scaling")


def draft_tensors(drafter, own_embeddings: bool) -> dict[str, tuple[np.ndarray, str]]:
    """llama.cpp tensor name -> (array in GGUF's row-major order, GGML type name)."""
    c = drafter.config
    out = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("midlayer."):
            gguf_name = "blk.0." + _LAYER[name.removeprefix("midlayer.")]
        elif name in _TOP and (name != "embed_tokens.weight" or own_embeddings):
            gguf_name = _TOP[name]
        else:
            continue  # t2d (unused at run time), d2t (below), a shared embedding table
        t = t.detach().cpu()
        if name.endswith("q_proj.weight"):
            t = rope_permute(t, c.num_heads)
        elif name.endswith("k_proj.weight"):
            t = rope_permute(t, c.num_kv_heads)
        if t.dim() == 1:  # norms: llama.cpp keeps 1-D tensors in F32
            out[gguf_name] = (t.float().numpy(), "F32")
        elif t.dtype == torch.bfloat16:
            out[gguf_name] = (t.contiguous().view(torch.int16).numpy().view(np.uint16), "BF16")
        else:
            out[gguf_name] = (t.contiguous().numpy(), _FLOAT_TYPES[t.dtype])
    d2t = drafter.d2t.detach().cpu().long()
    out["d2t"] = ((torch.arange(d2t.numel()) + d2t).numpy().astype(np.int64), "I64")  # offsets -> absolute ids
    return out


def _field_value(field):
    """A GGUFReader field's value and its GGUF types (scalar: (type, None); array: (ARRAY, element type))."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
    return field.contents(), vtype, sub


def target_metadata(target_gguf: Path) -> tuple[dict, list]:
    """(the target's width and layer count, its `tokenizer.*` fields as (key, value, type, subtype))."""
    from gguf import GGUFReader

    if not target_gguf.is_file():
        raise FileNotFoundError(f"{target_gguf}: no such GGUF file")
    try:
        reader = GGUFReader(target_gguf)
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct errors... on a bad file
        raise DraftExportError(f"{target_gguf} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    arch = reader.fields["general.architecture"].contents()
    hparams = {key: reader.fields[f"{arch}.{key}"].contents() for key in ("embedding_length", "block_count")
               if f"{arch}.{key}" in reader.fields}
    vocab = [(k, *_field_value(f)) for k, f in reader.fields.items() if k.startswith("tokenizer.")]
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in vocab):
        raise DraftExportError(f"{target_gguf} has no tokenizer (tokenizer.ggml.tokens): point --target at the GGUF "
                               "llama-server runs, as llama.cpp's convert_hf_to_gguf.py writes it")
    return hparams, vocab


def check_target(drafter, hparams: dict, vocab: list, target_gguf: Path) -> None:
    """The head must read layers the target has, at its width, over its vocabulary."""
    c = drafter.config
    width, layers = hparams.get("embedding_length"), hparams.get("block_count")
    if width != c.target_hidden_size:
        raise DraftExportError(f"the head was trained on a target of width {c.target_hidden_size}, {target_gguf.name} "
                               f"has width {width}: pass the head's own target as --target")
    if layers is None or max(c.feature_layer_ids) >= layers:
        raise DraftExportError(f"the head reads target layers {list(c.feature_layer_ids)}, {target_gguf.name} has "
                               f"{layers}: pass the head's own target as --target")
    n_tokens = len(next(v for k, v, *_ in vocab if k == "tokenizer.ggml.tokens"))
    if n_tokens != c.vocab_size:
        raise DraftExportError(f"the head maps drafts into a vocabulary of {c.vocab_size} tokens, {target_gguf.name} "
                               f"has {n_tokens}: pass the head's own target as --target")


def write_draft_gguf(drafter, target_gguf: str | Path, out: str | Path, name: str,
                     own_embeddings: bool = False) -> Path:
    """Write `drafter` (a one-layer EAGLE-3 head) as llama.cpp's draft GGUF for the target in `target_gguf`."""
    import gguf

    check_runnable(drafter)
    target_gguf, out = Path(target_gguf), Path(out)
    hparams, vocab = target_metadata(target_gguf)
    check_target(drafter, hparams, vocab, target_gguf)
    c = drafter.config
    tensors = draft_tensors(drafter, own_embeddings)
    w = gguf.GGUFWriter(out, arch=ARCH)
    w.add_array(f"{ARCH}.target_layers", [int(i) for i in c.feature_layer_ids])
    w.add_uint32(f"{ARCH}.target_hidden_size", c.target_hidden_size)
    w.add_bool(f"{ARCH}.norm_before_residual", bool(c.norm_before_residual))
    w.add_bool(f"{ARCH}.norm_before_fc", False)  # peagle's heads feed fc the raw features (it refuses others)
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[tensors["fc.weight"][1]]]))
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in vocab:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for tname, (array, kind) in tensors.items():
        w.add_tensor(tname, array, raw_dtype=gguf.GGMLQuantizationType[kind])
    out.parent.mkdir(parents=True, exist_ok=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
