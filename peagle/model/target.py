"""The target model: a plain-PyTorch decoder (Llama family, Gemma 3) that runs batched rows over a per-row KV cache.

One forward returns logits for the last `num_logits` query rows of every row and the three feature layers the
drafter reads (the residual stream entering layers `feature_layer_ids`, i.e. Hugging Face `hidden_states[id]`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from peagle.model import kernels, quant
from peagle.model.family import Family, family_of
from peagle.model.layers import (BatchLayout, DecoderLayer, KVCache, RMSNorm, RotaryEmbedding, SandwichDecoderLayer,
                                 UnitOffsetRMSNorm, float_copies, linear, release_float_copies, rope_inv_freq)
from peagle.model.quant import QuantEmbedding, QuantWeight

FULL_ATTENTION = "full_attention"  # transformers' layer_types names
SLIDING_ATTENTION = "sliding_attention"


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
    # Per layer: its attention kind (FULL_ATTENTION, or SLIDING_ATTENTION over the last `sliding_window` keys), each
    # kind with its own RoPE settings (`rope_parameters` is the full-attention layers', the one a drafter takes).
    layer_types: tuple[str, ...]
    sliding_window: int | None
    layer_rope: dict[str, dict]
    query_pre_attn_scalar: float | None  # attention scale 1 / sqrt(this) (default: head_dim)

    @classmethod
    def from_hf(cls, cfg: dict) -> "TargetConfig":
        model_type = cfg.get("model_type")
        family = family_of(model_type)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ValueError(f"{key} = {cfg[key]} is not supported by peagle's engine (Gemma 3 has none)")
        layer_types = tuple(cfg.get("layer_types") or [FULL_ATTENTION] * cfg["num_hidden_layers"])
        unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown or (SLIDING_ATTENTION in layer_types and not cfg.get("sliding_window")):
            raise ValueError(f"layer_types {sorted(set(layer_types))} with sliding_window {cfg.get('sliding_window')}: "
                             f"peagle's engine runs {FULL_ATTENTION} and {SLIDING_ATTENTION} layers (with a window)")
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
            attention_bias=cfg.get("attention_bias", family.attention_bias),
            qk_norm=family.qk_norm,
            eos_token_ids=eos,
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window") if SLIDING_ATTENTION in layer_types else None,
            layer_rope=layer_rope_parameters(cfg, set(layer_types)),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        )

    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    @property
    def feature_layer_ids(self) -> tuple[int, int, int]:
        return default_feature_layer_ids(self.num_layers)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        """How many keys (the query's own included) layer `layer` attends to; None: all before it."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None


def rope_parameters_of(cfg: dict) -> dict:
    """RoPE settings from a config in either the transformers 5 (`rope_parameters`) or 4 (`rope_theta`/`rope_scaling`)
    form; for a model whose layer kinds have RoPE settings of their own (Gemma 3), the full-attention layers'."""
    return layer_rope_parameters(cfg, {FULL_ATTENTION})[FULL_ATTENTION]


def layer_rope_parameters(cfg: dict, kinds: set[str]) -> dict[str, dict]:
    """The RoPE settings of each layer kind in `kinds`. transformers 5 keeps them per kind in `rope_parameters`
    (Gemma 3) or one dict for all; the 4 form has `rope_theta`/`rope_scaling`, and `rope_local_base_freq` for
    Gemma 3's sliding layers."""
    given = cfg.get("rope_parameters")
    if given and all(isinstance(v, dict) for v in given.values()):
        return {kind: dict(given[kind]) for kind in kinds}
    if given:
        return {kind: dict(given) for kind in kinds}
    params = dict(cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    out = {kind: dict(params) for kind in kinds}
    if SLIDING_ATTENTION in kinds and "rope_local_base_freq" in cfg:
        out[SLIDING_ATTENTION] = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return out


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, num_logits, V] float32
    features: torch.Tensor  # [B, T, 3 * hidden]


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig, rope: nn.ModuleDict):
        super().__init__()
        c = self.config = config
        # _build makes this on the meta device and load_state_dict fills it. An explicit empty weight skips
        # nn.Embedding's random init: any op on a meta tensor imports torch._dynamo and sympy (~60 MB resident)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size))
        # sqrt(hidden) rounded to the model's dtype, as transformers' Gemma scales its embeddings
        self.embed_scale = c.hidden_size ** 0.5 if c.family.scaled_embeddings else None
        self.layers = nn.ModuleList(decoder_layer(c, i) for i in range(c.num_layers))
        self.norm = norm_class(c.family)(c.hidden_size, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rotaries = rope  # one per layer kind (Gemma 3's sliding layers have their own base)
        self.feature_layer_ids = c.feature_layer_ids
        self.lm_head_packed = None  # set by pack_() where peagle's CPU kernels run
        self.native_layers = None  # set by pack_(): each layer in one native call (kernels.NativeDecoderLayer)

    @property
    def lm_head_weight(self) -> torch.Tensor | None:
        """The LM head's float weight (None when it is block-quantized: lm_head_packed holds it)."""
        if self.lm_head is None:
            return getattr(self.embed_tokens, "weight", None)
        return self.lm_head.weight

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def weights(self) -> str:
        """The number formats of the decoder layers' matrices ("bf16", "q4_1", a K-quant mix's "q5_0+q8_0+q4_k+q6_k"
        in order of first use), as stats and /v1/models name them; an LM head in another format is named after them
        ("q4_0, lm_head q8_0")."""
        used: dict[str, None] = {}
        for layer in self.layers:
            for packed in (layer.self_attn.qkv.packed, layer.self_attn.o_packed, layer.mlp.gate_up.packed,
                           layer.mlp.down_packed):
                for fmt in quant.format_of(packed, self.norm.weight).split("+"):
                    used[fmt] = None
        layers = "+".join(used)
        head = quant.format_of(self.lm_head_packed, self.norm.weight)
        return layers if head == layers else f"{layers}, lm_head {head}"

    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads: every matrix in the format it runs in (a packed bf16 copy counts
        once), the LM head, the norms; the embedding table only when it is not also the (tied) LM head."""
        matrices = [w for la in self.layers for w in (la.self_attn.qkv.packed, la.self_attn.o_packed,
                                                      la.mlp.gate_up.packed, la.mlp.down_packed)]
        if any(w is None for w in matrices):  # not packed (no native kernels): the plain parameters are read
            return sum(p.numel() * p.element_size() for p in self.state_dict().values())
        total = sum(w.nbytes for w in matrices) + (self.lm_head_packed.nbytes if self.lm_head_packed else 0)
        floats = [p for n, p in self.named_parameters() if p.dim() == 1]  # norms and biases
        return total + sum(p.numel() * p.element_size() for p in floats)

    def input_embeddings(self) -> torch.Tensor:
        """The token embedding table as a float tensor, for a head that holds its own (training, export); a
        block-quantized table is dequantized here, whole. An engine's head shares `embed_tokens` instead
        (checkpoint.load_head), so no copy of the table exists."""
        if isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.table()
        return self.embed_tokens.weight

    def output_embeddings(self) -> torch.Tensor:
        """The LM head as a float tensor [V, H] (a block-quantized one dequantized), for heads that start from it."""
        if self.lm_head_weight is not None:
            return self.lm_head_weight
        if isinstance(self.lm_head_packed, kernels.PackedWeight):  # pack_ released the float: the same bits
            return self.lm_head_packed.unpack()
        return self.lm_head_packed.dequantize().to(torch.bfloat16)

    def new_cache(self, num_slots: int, max_len: int, num_blocks: int | None = None) -> KVCache:
        """A paged cache for num_slots sequences of up to max_len positions, in num_blocks blocks (None: enough
        for every slot's whole context)."""
        p, c = self.norm.weight, self.config
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, p.dtype, p.device, num_blocks)

    @property
    def feature_dim(self) -> int:
        """Width of the features the drafter reads: the hidden states of the feature layers, side by side."""
        return len(self.feature_layer_ids) * self.config.hidden_size

    @property
    def quantized(self) -> bool:
        return isinstance(self.embed_tokens, QuantEmbedding)

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
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        ropes = {kind: rotary(layout.rotary_positions, h.dtype) for kind, rotary in self.rotaries.items()}
        cache.ensure(layout.slots, layout.positions)
        native = self.native_layers is not None and h.dtype == torch.bfloat16 and h.is_cpu
        if native:  # the whole layer in one call; the same bits as the modules below
            slots, positions = layout.slots.to(torch.int64).contiguous(), layout.positions.to(torch.int64).contiguous()
        feats = {}
        for i, layer in enumerate(self.layers):
            if i in self.feature_layer_ids:
                feats[i] = h
            rope = ropes[self.config.layer_types[i]]
            if native:
                h = self.native_layers[i](h, *rope, cache.layers[i].reading(layout.keys), slots, positions)
            else:
                h = layer(h, rope, layout, cache.layers[i])
        return h, torch.cat([feats[i] for i in self.feature_layer_ids], dim=-1)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                        quantization: str | None = None) -> "TargetModel":
        """A Hugging Face folder (safetensors), or a .gguf file whose block-quantized matrices stay as they are.
        `quantization` ("q4_0", "q4_1", "q8_0") quantizes a float model's matrices, LM head and embedding at load."""
        from safetensors.torch import load_file

        from peagle.model import gguf_model
        from peagle.model.loading import is_gguf

        path = Path(path)
        if is_gguf(path):
            if quantization:
                raise ValueError(f"--quantization {quantization} applies to float models; {path.name} is already "
                                 "quantized (its own formats are used as they are)")
            meta = gguf_model.metadata_dir(path)
            raw = json.loads((meta / "config.json").read_text())
            return cls._build(raw, gguf_model.read_tensors(path, raw), meta, "cpu")
        raw = json.loads((path / "config.json").read_text())
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            for name, tensor in load_file(f, device=str(device)).items():
                state[name.removeprefix("model.")] = tensor.to(dtype)
        if quantization:
            if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
                raise ValueError(f"--quantization {quantization} runs on peagle's CPU kernels, in bf16; drop it for "
                                 f"{dtype} on {device}")
            state = quantize_state(state, quantization, TargetConfig.from_hf(raw).tie_word_embeddings)
        return cls._build(raw, state, path, device)

    @classmethod
    def _build(cls, raw: dict, state: dict, config_dir: Path, device: str | torch.device) -> "TargetModel":
        """The model from its state: float tensors, and (format, GGUF blocks) for block-quantized matrices."""
        config = TargetConfig.from_hf(raw)
        hf_config = None
        if any(p.get("rope_type", "default") != "default" for p in config.layer_rope.values()):
            from transformers import AutoConfig  # its RoPE functions read the whole config (imported only then)

            hf_config = AutoConfig.from_pretrained(config_dir)
        rope = rotaries(config, hf_config).to(device)  # computed, so not on the meta device
        with torch.device("meta"):
            model = cls(config, rope)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        blocks = {name: v for name, v in state.items() if isinstance(v, tuple)}
        floats = {name: v for name, v in state.items() if not isinstance(v, tuple)}
        if blocks:
            quant.require_kernels("a block-quantized model")
            if "embed_tokens.weight" in blocks:
                fmt, data = blocks.pop("embed_tokens.weight")
                model.embed_tokens = QuantEmbedding(QuantWeight.from_blocks(data, fmt, config.vocab_size,
                                                                            config.hidden_size))
        missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
        missing = [m for m in missing if m not in blocks and not (m == "embed_tokens.weight" and model.quantized)]
        if missing or unexpected:
            raise ValueError(f"the model's tensors do not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        model = model.eval().requires_grad_(False).pack_(blocks=blocks)
        if blocks:
            del blocks, state
            quant.release_freed_memory()
        return model

    @torch.no_grad()
    def pack_(self, path: str | None = None, blocks: dict | None = None) -> "TargetModel":
        """Inference layout (from_pretrained does it): q/k/v and gate/up projections each become one matrix (the
        original parameters become views of it), and where peagle's CPU kernels run, every projection and the LM
        head are packed once for them (kernels.py) and the packed bf16 copy replaces the float weight (the
        embedding table stays: lookups read it), so the weights are held once and state_dict() lacks them. The
        frozen target never changes after. `path` picks a matrix path of kernels.PATHS (default: the machine's
        fastest); packing again unpacks the released weights first, bit for bit. `blocks` holds the block-quantized
        matrices by name, (format, GGUF blocks): those are regrouped for the quantized kernels instead, and no float
        copy of them exists."""
        blocks = blocks or {}
        self._restore_released_floats()
        for i, layer in enumerate(self.layers):
            layer.self_attn.pack_(path, blocks, f"layers.{i}.self_attn.")
            layer.mlp.pack_(path, blocks, f"layers.{i}.mlp.")
        if "lm_head.weight" in blocks:
            fmt, data = blocks["lm_head.weight"]
            self.lm_head_packed = QuantWeight.from_blocks(data, fmt, self.config.vocab_size, self.config.hidden_size)
        elif self.quantized and self.lm_head is None:
            self.lm_head_packed = self.embed_tokens.quant  # tied: the LM head reads the embedding's blocks
        else:
            self.lm_head_packed = kernels.PackedWeight.pack(self.lm_head_weight, path)
        self._release_packed_floats()  # before the native layers take the norms' pointers
        c = self.config
        llama = c.family.llama_block and not c.attention_bias
        self.native_layers = None if not llama else kernels.NativeDecoderLayer.for_layers(
            list(self.layers), c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
        return self

    def _float_copies(self) -> list[tuple[kernels.PackedWeight, list[nn.Module]]]:
        """Each bf16 packed matrix with the modules holding its float weight; a tied LM head is packed from the
        embedding table, which stays (lookups read it). NativeDecoderLayer reads only packed copies and norms."""
        out = [m for layer in self.layers for m in float_copies(layer)]
        if self.lm_head is not None:
            out.append((self.lm_head_packed, [self.lm_head]))
        return [(packed, holders) for packed, holders in out if isinstance(packed, kernels.PackedWeight)]

    def _release_packed_floats(self) -> None:
        released = self._float_copies()
        release_float_copies(released)
        if released:
            self._copy_out_of_mapped_files()

    def _copy_out_of_mapped_files(self) -> None:
        """safetensors hands out views of the file it maps (storage that torch did not allocate, so not resizable),
        and the whole mapping stays resident while any view lives: the tensors kept (embedding table, norms, biases)
        get memory of their own, so the released matrices' pages go with the mapping."""
        for module in self.modules():
            kept = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, t in kept:
                if not t.untyped_storage().resizable():
                    setattr(module, name, nn.Parameter(t.clone(), requires_grad=False)
                            if isinstance(t, nn.Parameter) else t.clone())

    def _restore_released_floats(self) -> None:
        """The float weights _release_packed_floats dropped, unpacked from their packed copies (to pack again)."""
        for packed, (module, *parts) in self._float_copies():
            if module.weight is not None:
                continue
            weight = packed.unpack()
            pieces = weight.split([p.out_features for p in parts]) if parts else [weight]
            for owner, w in zip(parts or [module], pieces):  # FusedLinear.pack_ fuses its parts again
                owner.weight = nn.Parameter(w, requires_grad=False)


def norm_class(family: Family) -> type[RMSNorm]:
    return UnitOffsetRMSNorm if family.norm_unit_offset else RMSNorm


def decoder_layer(c: TargetConfig, i: int) -> nn.Module:
    """Layer i as its family builds it: Llama's block, or Gemma's with norms around attention and MLP."""
    if not c.family.sandwich_norms:
        return DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.rms_norm_eps, attention_bias=c.attention_bias, qk_norm=c.qk_norm)
    return SandwichDecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                c.rms_norm_eps, norm_class(c.family), c.family.activation, c.window_of(i),
                                c.attention_scale)


def rotaries(c: TargetConfig, hf_config=None) -> nn.ModuleDict:
    """RoPE for each layer kind of the model, from that kind's settings."""
    per_kind = len(c.layer_rope) > 1
    return nn.ModuleDict({kind: RotaryEmbedding(*rope_inv_freq(params, c.head_dim, hf_config,
                                                                kind if per_kind else None))
                          for kind, params in c.layer_rope.items()})


def quantize_state(state: dict[str, torch.Tensor], fmt: str, tied: bool,
                   embedding_fmt: str = quant.EMBEDDING_QUANTIZATION) -> dict:
    """A float state dict with every decoder matrix in `fmt` blocks and the LM head and embedding table in
    `embedding_fmt` blocks (GGUF blocks, as a file would hold them)."""
    if fmt not in quant.QUANTIZATIONS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(quant.QUANTIZATIONS)}")
    quant.require_kernels(f"--quantization {fmt}")
    out = {}
    for name, value in state.items():
        if name.endswith("_proj.weight"):
            out[name] = (fmt, quant.quantize_blocks(value, fmt))
        elif name in ("lm_head.weight", "embed_tokens.weight") and not (tied and name == "lm_head.weight"):
            out[name] = (embedding_fmt, quant.quantize_blocks(value, embedding_fmt))
        else:
            out[name] = value
    return out
