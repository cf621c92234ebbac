"""Drafter checkpoints: a folder with config.json + model.safetensors (DESIGN section 5).

Layouts written: `vllm` (what vLLM's LlamaForCausalLMEagle3 loads unchanged) and `speculators` (the same tensors,
with a `speculators_config` naming the verifier). Loading accepts both, plus SpecForge/EAGLE names (`midlayer.*`,
`layers.0.*`, a `model.` prefix).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from peagle.model.drafter import Drafter, DrafterConfig
from peagle.model.target import TargetConfig

LAYOUTS = ("vllm", "speculators")


def save_head(drafter: Drafter, out: str | Path, layout: str = "vllm", verifier: str | None = None,
              include_embeddings: bool | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a head. Embeddings are written for P-EAGLE heads (the mask row is learned); EAGLE-3 heads share the
    target's, as vLLM does when `embed_tokens.weight` is absent."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    if include_embeddings is None:
        include_embeddings = c.parallel_capable
    state = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("embed_tokens.") and not include_embeddings:
            continue
        if name == "mask_hidden":
            t = t.reshape(1, 1, -1)
        state[name] = t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous().cpu()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = c.to_hf_dict()
    if layout == "speculators":
        cfg = speculators_config(cfg, verifier, method="peagle" if c.parallel_capable else "eagle3")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def speculators_config(cfg: dict, verifier: str | None, method: str) -> dict:
    """Wrap a vLLM head config in the speculators layout."""
    d = dict(cfg)
    d["architectures"] = ["Eagle3Speculator"] if method == "eagle3" else ["PEagleSpeculator"]
    d["speculators_model_type"] = method
    d["speculators_version"] = "0.3.0"
    d["transformer_layer_config"] = {k: cfg[k] for k in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
        "rope_parameters") if k in cfg}
    d["speculators_config"] = {
        "algorithm": method,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
    }
    return d


def _rename(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def load_head(path: str | Path, target_embeddings: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
              device: str | torch.device = "cpu") -> Drafter:
    """Load a head in any accepted layout. `target_embeddings` fills `embed_tokens` when the checkpoint has none."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a drafter head folder (no config.json); create one with "
                                "`peagle export --random-init` or `peagle train`")
    raw = json.loads((path / "config.json").read_text())
    if "transformer_layer_config" in raw and "hidden_size" not in raw:
        raw = {**raw["transformer_layer_config"], **raw}
    config = DrafterConfig.from_hf_dict(raw)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update({_rename(k): v for k, v in load_file(f).items()})
    if config.mask_token_id is None and "mask_hidden" in state:
        raise ValueError(f"{path}: has mask_hidden but no mask_token_id in config.json")
    drafter = Drafter(config)
    if "embed_tokens.weight" not in state:
        if target_embeddings is None:
            raise ValueError(f"{path} has no embed_tokens.weight; pass the target's embeddings")
        state["embed_tokens.weight"] = target_embeddings
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


def _cast(drafter: Drafter, dtype: torch.dtype, device) -> Drafter:
    drafter = drafter.to(device)
    for p in drafter.parameters():
        p.data = p.data.to(dtype)
    return drafter.eval().requires_grad_(False)


def random_head(target: TargetConfig, target_embeddings: torch.Tensor, method: str = "peagle", num_layers: int = 1,
                mask_token_id: int | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Drafter:
    """An untrained head for `target` (full draft vocab). P-EAGLE heads get a mask token (default: the first id the
    tokenizer never produces is up to the caller; SmolLM2 uses 3) and a random `mask_hidden`."""
    if method not in ("peagle", "eagle3"):
        raise ValueError(f"method must be peagle or eagle3, not {method!r}")
    if method == "peagle" and mask_token_id is None:
        raise ValueError("a P-EAGLE head needs a mask_token_id: an id the tokenizer never produces")
    config = DrafterConfig.for_target(target, num_layers=num_layers,
                                      mask_token_id=mask_token_id if method == "peagle" else None)
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
