"""Drafter checkpoints: a folder with config.json + model.safetensors (docs/design.md, "Checkpoints").

Layouts written: `vllm` (what vLLM's LlamaForCausalLMEagle3 loads unchanged) and `speculators` (the same tensors,
with a `speculators_config` naming the verifier). Loading accepts both, plus SpecForge/EAGLE names (`midlayer.*`,
`layers.0.*`, a `model.` prefix).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from peagle.config import DEFAULT_NUM_SPECULATIVE_TOKENS
from peagle.model.drafter import Drafter, DrafterConfig, SharedEmbedding, lookup_device
from peagle.model.heads import UNTRAINED_KEY
from peagle.model.target import TargetConfig

LAYOUTS = ("vllm", "speculators")
MASK_ROW = "mask_token_embedding"  # [1, H]: the learned mask row, in heads saved without the embedding table


def save_head(drafter: Drafter, out: str | Path, layout: str = "vllm", verifier: str | None = None,
              include_embeddings: bool | None = None, dtype: torch.dtype = torch.bfloat16,
              num_speculative_tokens: int | None = None, verifier_architectures: list[str] | None = None) -> Path:
    """Write a head. Embeddings are written for P-EAGLE heads (the mask row is learned) and for every head in the
    speculators layout (speculators 0.9 loads a head without them as an all-zero table); vLLM-layout EAGLE-3 heads
    share the target's, as vLLM does when `embed_tokens.weight` is absent.

    `vllm` names layer 0 `midlayer.*` (as SpecForge and EAGLE do); `speculators` names it `layers.0.*` (as the
    speculators library does). vLLM loads both."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    from safetensors.torch import save_file

    if drafter.lm_head.weight is None:
        raise ValueError("this head was packed for inference (Drafter.pack_), which releases its float weights: save "
                         "the head as loaded (load_head), before packing it")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    if include_embeddings is None:
        include_embeddings = c.parallel_capable or layout == "speculators"
    state, tensors = {}, drafter.state_dict()
    if isinstance(drafter.embed_tokens, SharedEmbedding):  # an engine's head: the table it looks up, as its own
        tensors["embed_tokens.weight"] = drafter.embed_tokens.table()
    for name, t in tensors.items():
        if name.startswith("embed_tokens.") and not include_embeddings:
            if c.parallel_capable:
                # Compact form (the bundled heads): keep only the learned mask-token row; loading takes every other
                # row from the target. `peagle export` writes the full table vLLM wants.
                state[MASK_ROW] = t[c.mask_token_id : c.mask_token_id + 1].detach().to(dtype).contiguous().cpu()
            continue
        if name == "mask_hidden":
            t = t.reshape(1, 1, -1)
        if layout == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        state[name] = t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous().cpu()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = c.to_hf_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    if layout == "speculators":
        cfg = speculators_config(cfg, verifier, method="peagle" if c.parallel_capable else "eagle3",
                                 num_speculative_tokens=num_speculative_tokens,
                                 verifier_architectures=verifier_architectures)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# The decoder-layer config vLLM builds a speculators head from (it reads only `transformer_layer_config` plus the
# algorithm's own top-level fields: draft_vocab_size, target_hidden_size, norm_before_residual, mask_token_id, ...).
_LAYER_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "vocab_size",
                      "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
                      "tie_word_embeddings", "torch_dtype")


def speculators_config(cfg: dict, verifier: str | None, method: str, num_speculative_tokens: int | None = None,
                       verifier_architectures: list[str] | None = None) -> dict:
    """Wrap a vLLM head config in the speculators layout (`speculators_model_type` "peagle" or "eagle3"): the
    decoder-layer fields in `transformer_layer_config`, the head's own fields at top level."""
    layer = {k: cfg[k] for k in _LAYER_CONFIG_KEYS if k in cfg}
    layer.update({"architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False})
    k = num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
    d = {
        "architectures": ["Eagle3Speculator"] if method == "eagle3" else ["PEagleSpeculator"],
        "speculators_model_type": method,
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "norm_before_residual": cfg["norm_before_residual"],
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        "torch_dtype": cfg.get("torch_dtype", "bfloat16"),
        "speculators_config": {
            "algorithm": method,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier,
                         "architectures": list(verifier_architectures or ["LlamaForCausalLM"])},
        },
    }
    if method == "peagle":
        d["mask_token_id"] = cfg["mask_token_id"]
    # Anything else the head carries (unknown keys kept from the file it was loaded from) stays at top level.
    known = set(_LAYER_CONFIG_KEYS) | set(DrafterConfig.for_hf_keys()) | {
        "draft_vocab_size", "target_hidden_size", "mask_token_id", "rope_parameters"}
    for key, value in cfg.items():
        if key not in known and key not in d:
            d[key] = value
    return d


def _rename(name: str) -> str:
    """Checkpoint tensor name -> ours: drop a `model.` prefix (SpecForge, speculators wrappers); layer 0 is `midlayer`."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    if name == "draft_id_to_target_id":  # vLLM's in-memory name for d2t
        return "d2t"
    return name


def load_head(path: str | Path, target_embeddings: torch.Tensor | nn.Module | None = None,
              dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Drafter:
    """Load a head in any accepted layout. `target_embeddings` fills `embed_tokens` when the checkpoint has none:
    a table [V, H] is copied into the head's own nn.Embedding (a head to train or export); the target's embedding
    module (TargetModel.embed_tokens) is shared, looked up as the target looks it up (an engine's head: the same
    drafts with no copy of the table, which a block-quantized target would have to dequantize whole)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a drafter head folder (no config.json); create one with "
                                "`peagle export --random-init` or `peagle train`")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    layer_cfg = raw.get("transformer_layer_config") or raw.get("transformer_config")
    if isinstance(layer_cfg, dict):
        # speculators layout: the decoder-layer fields live in transformer_layer_config, the head's at top level.
        raw = {**layer_cfg, **{k: v for k, v in raw.items() if k != "architectures"}}
    if raw.get("norm_before_fc"):
        raise ValueError(f"{path}: norm_before_fc=true heads are not supported (peagle's drafter feeds fc the raw "
                         "target features, as vLLM does for EAGLE-3 heads)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise ValueError(f"{path / 'config.json'} is not a drafter head config: missing {', '.join(missing)}")
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update({_rename(k): v for k, v in load_file(f).items()})
    if not state:
        raise FileNotFoundError(f"{path} has a config.json but no *.safetensors weights")
    if not raw.get("draft_vocab_size") and "lm_head.weight" in state:
        raw["draft_vocab_size"] = state["lm_head.weight"].shape[0]
    config = DrafterConfig.from_hf_dict(raw)
    if config.mask_token_id is None and "mask_hidden" in state:
        raise ValueError(f"{path}: has mask_hidden but no mask_token_id in config.json")
    if config.mask_token_id is not None and "mask_hidden" not in state:
        raise ValueError(f"{path}: config.json names a mask token ({config.mask_token_id}) but the weights have no "
                         "mask_hidden, so this is not a P-EAGLE head")
    shared = None
    if "embed_tokens.weight" not in state:
        if target_embeddings is None:
            raise ValueError(f"{path} has no embed_tokens.weight; pass the target's embeddings")
        if isinstance(target_embeddings, nn.Module):
            shared = _shared_embedding(path, config, target_embeddings, state.pop(MASK_ROW, None), dtype)
        else:
            embed = target_embeddings
            if MASK_ROW in state:  # compact P-EAGLE head: the target's table with the learned mask row put back
                embed = target_embeddings.detach().clone()
                embed[config.mask_token_id] = state.pop(MASK_ROW)[0].to(embed.dtype)
            state["embed_tokens.weight"] = embed
    with _no_random_init():  # the checkpoint fills every parameter, or this raises below
        drafter = Drafter(config, embed_tokens=shared)
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
    state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    state.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match its config: missing {missing}, unexpected {unexpected}")
    drafter.d2t = drafter.d2t.long()
    drafter.t2d = drafter.t2d.bool()
    return _cast(drafter, dtype, device)


@contextmanager
def _no_random_init():
    """Linear and embedding modules built here keep their new parameters' memory as it is instead of drawing
    random weights the checkpoint overwrites: the draw was most of loading the embedded head (0.13 s of CPU, a
    [draft vocab x H] LM head's among it), on every start of a server."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _shared_embedding(path: Path, config: DrafterConfig, lookup: nn.Module, mask_row: torch.Tensor | None,
                      dtype: torch.dtype) -> SharedEmbedding:
    """The target's embedding module shared by a head, with a compact P-EAGLE head's learned mask row [1, H]."""
    if (lookup.num_embeddings, lookup.embedding_dim) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{path} is a head for a vocabulary of {config.vocab_size} and width {config.hidden_size}, but "
                         f"the target's embedding is {lookup.num_embeddings} x {lookup.embedding_dim}: pass the "
                         "head trained for this target")
    if mask_row is not None:  # rounded as a row put into the target's table would be (load_head's copy)
        probe = lookup(torch.tensor([config.mask_token_id], device=lookup_device(lookup)))
        mask_row = mask_row[0].to(probe.dtype).clone()  # not a view: it would keep the whole file mapped
    return SharedEmbedding(lookup, dtype, config.mask_token_id if mask_row is not None else None, mask_row)


def _cast(drafter: Drafter, dtype: torch.dtype, device) -> Drafter:
    drafter = drafter.to(device)
    for p in drafter.parameters():
        p.data = p.data.to(dtype)
    return drafter.eval().requires_grad_(False)


def random_head(target: TargetConfig, target_embeddings: torch.Tensor, method: str = "peagle", num_layers: int = 1,
                mask_token_id: int | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Drafter:
    """An untrained head for `target` (full draft vocab). P-EAGLE heads need `mask_token_id` (the caller picks it
    with mask_token.choose_mask_token_id) and get a random `mask_hidden`."""
    if method not in ("peagle", "eagle3"):
        raise ValueError(f"method must be peagle or eagle3, not {method!r}")
    if method == "peagle" and mask_token_id is None:
        raise ValueError("a P-EAGLE head needs a mask_token_id: an id the tokenizer never produces")
    config = DrafterConfig.for_target(target, num_layers=num_layers,
                                      mask_token_id=mask_token_id if method == "peagle" else None)
    config.extra[UNTRAINED_KEY] = True  # so benchmarks and reports can say the head was never trained
    g = torch.Generator().manual_seed(seed)
    drafter = Drafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "embed_tokens.weight":
                p.copy_(target_embeddings.float())
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return _cast(drafter, dtype, target_embeddings.device)
