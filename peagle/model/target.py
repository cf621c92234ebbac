"""The target model: a plain-PyTorch Llama-family decoder that runs batched rows over a per-row KV cache.

One forward returns logits for the last `num_logits` query rows of every row and the three feature layers the
drafter reads (the residual stream entering layers `feature_layer_ids`, i.e. Hugging Face `hidden_states[id]`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from peagle.model import kernels
from peagle.model.layers import BatchLayout, DecoderLayer, KVCache, RMSNorm, RotaryEmbedding, linear, rope_inv_freq

SUPPORTED_ARCHITECTURES = {"llama": "Llama 2/3, SmolLM2", "mistral": "Mistral", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3"}


def default_feature_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's EAGLE-3 auxiliary layer ids for an L-layer target: (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict) -> "TargetConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise ValueError(f"model_type {model_type!r} is not supported by peagle's engine; supported: {names}. "
                             "Training (`peagle train`) accepts any transformers causal LM.")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_parameters=rope_parameters_of(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos,
        )

    @property
    def feature_layer_ids(self) -> tuple[int, int, int]:
        return default_feature_layer_ids(self.num_layers)


def rope_parameters_of(cfg: dict) -> dict:
    """RoPE settings from a config in either the transformers 5 (`rope_parameters`) or 4 (`rope_theta`/`rope_scaling`) form."""
    if cfg.get("rope_parameters"):
        return dict(cfg["rope_parameters"])
    params = dict(cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    return params


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, num_logits, V] float32
    features: torch.Tensor  # [B, T, 3 * hidden]


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig, hf_config=None):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                         attention_bias=c.attention_bias, qk_norm=c.qk_norm)
            for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(*rope_inv_freq(c.rope_parameters, c.head_dim, hf_config))
        self.feature_layer_ids = c.feature_layer_ids
        self.lm_head_packed = None  # set by pack_() where peagle's CPU kernels run
        self.native_layers = None  # set by pack_(): each layer in one native call (kernels.NativeDecoderLayer)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.config.num_layers, num_slots, max_len, self.config.num_kv_heads, self.config.head_dim,
                       p.dtype, p.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, layout: BatchLayout, cache: KVCache,
                num_logits: int | None = 1, logit_index: torch.Tensor | None = None) -> TargetOutput:
        """tokens [B, T]; logits for the last `num_logits` query rows (all rows if None), or for the rows
        `logit_index` [B, n] picks (e.g. each row's last real token in a padded batch)."""
        h, features = self.trunk(tokens, layout, cache)
        if logit_index is not None:
            h = h.gather(1, logit_index[..., None].expand(*logit_index.shape, h.shape[-1]))
        elif num_logits is not None:
            h = h[:, -num_logits:]
        return TargetOutput(self.logits(h), features)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the last layer's hidden states h [..., H] (before the final norm)."""
        return linear(self.norm(h), self.lm_head_weight, packed=self.lm_head_packed).float()

    @torch.inference_mode()
    def trunk(self, tokens: torch.Tensor, layout: BatchLayout, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (the last layer's hidden states [B, T, H] before the final norm, features [B, T, 3H])."""
        h = self.embed_tokens(tokens)
        rope = self.rotary(layout.positions, h.dtype)
        native = self.native_layers is not None and h.dtype == torch.bfloat16 and h.is_cpu
        if native:  # the whole layer in one call; the same bits as the modules below
            slots, positions = layout.slots.to(torch.int64).contiguous(), layout.positions.to(torch.int64).contiguous()
        feats = {}
        for i, layer in enumerate(self.layers):
            if i in self.feature_layer_ids:
                feats[i] = h
            if native:
                h = self.native_layers[i](h, *rope, cache.k[i], cache.v[i], slots, positions)
            else:
                h = layer(h, rope, layout, cache.k[i], cache.v[i])
        return h, torch.cat([feats[i] for i in self.feature_layer_ids], dim=-1)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> "TargetModel":
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        config = TargetConfig.from_hf(raw)
        hf_config = AutoConfig.from_pretrained(path) if config.rope_parameters.get("rope_type", "default") != "default" else None
        with torch.device("meta"):
            model = cls(config, hf_config)
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            for name, tensor in load_file(f, device=str(device)).items():
                state[name.removeprefix("model.")] = tensor.to(dtype)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = RotaryEmbedding(*rope_inv_freq(config.rope_parameters, config.head_dim, hf_config)).to(device)
        return model.eval().requires_grad_(False).pack_()

    @torch.no_grad()
    def pack_(self, path: str | None = None) -> "TargetModel":
        """Inference layout (from_pretrained does it): q/k/v and gate/up projections each become one matrix (the
        original parameters become views, so memory and state_dict names are unchanged), and where peagle's CPU
        kernels run, every projection and the LM head are also packed once for them (kernels.py; a packed copy of
        the weights, so the model takes twice the weight memory). The frozen target never changes after. `path`
        picks a matrix path of kernels.PATHS (default: the machine's fastest)."""
        for layer in self.layers:
            layer.self_attn.pack_(path)
            layer.mlp.pack_(path)
        self.lm_head_packed = kernels.PackedWeight.pack(self.lm_head_weight, path)
        self.native_layers = None
        c = self.config
        if not (c.attention_bias or c.qk_norm):
            packed = [[la.self_attn.qkv.packed, la.self_attn.o_packed, la.mlp.gate_up.packed, la.mlp.down_packed]
                      for la in self.layers]
            if all(kernels.NativeDecoderLayer.applies(p, c.head_dim, c.intermediate_size) for p in packed):
                self.native_layers = [
                    kernels.NativeDecoderLayer(la.input_layernorm.weight, la.post_attention_layernorm.weight, *p,
                                               c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
                    for la, p in zip(self.layers, packed)]
        return self
