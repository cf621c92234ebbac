"""The drafter head in EAGLE-3 layout, with P-EAGLE's two learned placeholders.

    g_t (3*Ht) --fc--> h_t (H)
    layer 0 (fusion):  e = input_layernorm(embed(token)); x = attn(cat[e, hidden_norm(h)]) + r
                       r = h, or hidden_norm(h) when norm_before_residual (vLLM and speculators read the flag)
                       out = x + mlp(post_attention_layernorm(x))
    layers 1..N-1:     plain Llama decoder layers
    logits:            lm_head(norm(out)) over the draft vocab; draft id i -> target id i + d2t[i]

Two ways to draft K tokens (docs/design.md, "Drafter"):
  * chain (EAGLE-3): K passes, each feeding back the previous pass's pre-norm output and its own draft (or, for a
    draft tree, the most probable nodes of each depth as rows of one pass: EAGLE-2's dynamic tree);
  * parallel (P-EAGLE): one pass over [real rows | K-1 mask slots], each slot carrying the mask token and
    `mask_hidden` at the next position.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from peagle.model import kernels
from peagle.model.layers import (BatchLayout, DecoderLayer, KVCache, LayerKV, RMSNorm, RotaryEmbedding, float_copies,
                                 linear, pack_matrix, release_float_copies, rope_inv_freq)
from peagle.model.target import TargetConfig, rope_parameters_of


# (depth, draft-vocabulary logits [B, Vd]) -> the drafts at that depth as target ids [B]; called for depth 0, 1, ...
DraftPick = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rope_parameters: dict
    max_position_embeddings: int
    feature_layer_ids: tuple[int, ...]
    mask_token_id: int | None = None  # set for P-EAGLE heads
    # Layer 0's residual is hidden_norm(h) instead of h: a large fc(feature) then cannot swamp what attention adds.
    norm_before_residual: bool = False
    extra: dict = field(default_factory=dict)  # unknown config.json keys, kept on save

    @property
    def parallel_capable(self) -> bool:
        return self.mask_token_id is not None

    @classmethod
    def for_target(cls, target: TargetConfig, num_layers: int = 1, draft_vocab_size: int | None = None,
                   mask_token_id: int | None = None, norm_before_residual: bool = False) -> "DrafterConfig":
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_layers=num_layers,
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   rms_norm_eps=target.rms_norm_eps, vocab_size=target.vocab_size,
                   draft_vocab_size=draft_vocab_size or target.vocab_size, target_hidden_size=target.hidden_size,
                   rope_parameters=dict(target.rope_parameters),
                   max_position_embeddings=target.max_position_embeddings,
                   feature_layer_ids=tuple(target.feature_layer_ids), mask_token_id=mask_token_id,
                   norm_before_residual=norm_before_residual)

    def to_hf_dict(self) -> dict:
        """config.json in the layout vLLM's LlamaForCausalLMEagle3 loads (docs/design.md, "Checkpoints")."""
        rope = dict(self.rope_parameters)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        d = dict(self.extra)
        d.update({
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": rope.get("rope_theta"),
            "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
            "rope_parameters": rope,
            "eagle_aux_hidden_state_layer_ids": list(self.feature_layer_ids),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.feature_layer_ids),
                             "use_aux_hidden_state": True},
            "norm_before_residual": self.norm_before_residual,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        })
        if self.mask_token_id is not None:
            d.update({"mask_token_id": self.mask_token_id, "ptd_token_id": self.mask_token_id,
                      "pard_token": self.mask_token_id, "parallel_drafting": True})
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        heads = d["num_attention_heads"]
        ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        mask_id = next((d[k] for k in ("mask_token_id", "ptd_token_id", "pard_token") if d.get(k) is not None), None)
        known = set(cls.__dataclass_fields__) | set(DrafterConfig.for_hf_keys())
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_layers=d.get("num_hidden_layers", 1), num_heads=heads,
                   num_kv_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
                   rope_parameters=rope_parameters_of(d), max_position_embeddings=d.get("max_position_embeddings", 4096),
                   feature_layer_ids=tuple(ids) if ids else (), mask_token_id=mask_id,
                   norm_before_residual=bool(d.get("norm_before_residual", False)),
                   extra={k: v for k, v in d.items() if k not in known})

    @staticmethod
    def for_hf_keys() -> tuple[str, ...]:
        """Keys to_hf_dict writes itself (never carried through `extra`)."""
        return ("architectures", "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "hidden_act", "rope_theta", "rope_scaling", "eagle_aux_hidden_state_layer_ids", "eagle_config",
                "norm_before_residual", "tie_word_embeddings", "torch_dtype", "ptd_token_id", "pard_token",
                "parallel_drafting", "dtype", "attention_bias", "mlp_bias",
                # the speculators layout's wrapper, rebuilt by save_head(layout="speculators") when asked for
                "speculators_model_type", "speculators_version", "speculators_config", "transformer_layer_config",
                "transformer_config")

    def as_dict(self) -> dict:
        return asdict(self)


class FusionLayer(DecoderLayer):
    """Drafter layer 0: attention reads [normed token embedding, normed feature] (width 2H)."""

    def __init__(self, c: DrafterConfig):
        super().__init__(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                         attn_in_dim=2 * c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm_before_residual = c.norm_before_residual

    def inputs(self, embeds: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input cat[e, hidden_norm(h)] of width 2H, the residual the attention output is added to)."""
        hn = self.hidden_norm(h)
        return torch.cat([self.input_layernorm(embeds), hn], dim=-1), hn if self.norm_before_residual else h

    def forward(self, embeds: torch.Tensor, h: torch.Tensor, rope, layout: BatchLayout, kv: LayerKV | None):
        x, residual = self.inputs(embeds, h)
        x = residual + self.self_attn(x, rope, layout, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedEmbedding(nn.Module):
    """The target's token embedding, looked up through the target's own module, with the head's learned row at
    P-EAGLE's mask token. No copy of the table exists: a float table is the target's tensor, and a block-quantized
    one stays in its blocks (QuantEmbedding returns each row with the bits its dequantized table would hold), so
    the drafts are those of a head holding the table itself. For inference: a head in training owns its table."""

    def __init__(self, lookup: nn.Module, dtype: torch.dtype, mask_token_id: int | None = None,
                 mask_row: torch.Tensor | None = None):
        super().__init__()
        self._target = (lookup,)  # not a submodule: the head's .to(), casts and state_dict leave the target alone
        self.dtype, self.mask_token_id = dtype, mask_token_id
        self.num_embeddings, self.embedding_dim = lookup.num_embeddings, lookup.embedding_dim
        self.register_buffer("mask_row", None if mask_row is None else mask_row.to(dtype), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self._target[0](tokens).to(self.dtype)
        if self.mask_row is None:
            return e
        return torch.where((tokens == self.mask_token_id)[..., None], self.mask_row, e)

    def table(self) -> torch.Tensor:
        """The whole table [V, H] as a head holding its own would have it (for saving such a head)."""
        return self(torch.arange(self.num_embeddings, device=lookup_device(self._target[0])))


def lookup_device(lookup: nn.Module) -> torch.device:
    """Where an embedding module looks its rows up (a QuantEmbedding has no float weight: it runs on the CPU)."""
    weight = getattr(lookup, "weight", None)
    return weight.device if weight is not None else torch.device("cpu")


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, embed_tokens: SharedEmbedding | None = None):
        """`embed_tokens`: the target's table shared (an engine's head); None: the head's own nn.Embedding."""
        super().__init__()
        c = self.config = config
        H = c.hidden_size
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(c.vocab_size, H)
        self.fc = nn.Linear(3 * c.target_hidden_size, H, bias=False)
        self.midlayer = FusionLayer(c)
        # Keyed by layer id (1..N-1) so checkpoint names read `layers.{1..}.*` as vLLM expects.
        self.layers = nn.ModuleDict({
            str(i): DecoderLayer(H, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
            for i in range(1, c.num_layers)})
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        # P-EAGLE's stand-in for the target feature at future positions; present only on parallel-capable heads.
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * c.target_hidden_size)) if c.parallel_capable else None
        self.rotary = RotaryEmbedding(*rope_inv_freq(c.rope_parameters, c.head_dim, _hf_rope_config(c)))
        self.fc_packed = self.lm_head_packed = None  # set by pack_()
        self.native_layers = None  # set by pack_(): each layer in one native call (kernels.NativeDecoderLayer)

    @torch.no_grad()
    def pack_(self, quantization: str | None = None) -> "Drafter":
        """For inference with bf16 weights on a CPU with AMX: pack every projection once for peagle's kernel
        (kernels.py; about 1.5-2x faster drafting). The packed copies replace the float weights (fc's aside): call it
        on a head that will not be trained or saved any more (the engine's), never during training. No-op elsewhere.
        `quantization` ("q8_0", ...) puts the layers' projections and the LM head into that block format instead
        (drafts change a little, never the output: the target verifies every one)."""
        blocks = {}
        if quantization:
            from peagle.model.quant import quantize_blocks

            blocks = {name: (quantization, quantize_blocks(p, quantization)) for name, p in self.named_parameters()
                      if name.endswith("_proj.weight") or name == "lm_head.weight"}
        for name, layer in [("midlayer", self.midlayer), *((f"layers.{i}", la) for i, la in self.layers.items())]:
            layer.self_attn.pack_(None, blocks, f"{name}.self_attn.")
            layer.mlp.pack_(None, blocks, f"{name}.mlp.")
        self.fc_packed = kernels.PackedWeight.pack(self.fc.weight)
        self.lm_head_packed = pack_matrix(self.lm_head, None, blocks, "lm_head.weight")
        # Each layer in one native call, as the target's (the same bits as the modules): at batch 1 the Python
        # between a layer's dozen kernels cost about as much as the kernels themselves.
        c = self.config
        self.native_layers = kernels.NativeDecoderLayer.for_layers(
            [self.midlayer, *self.layers.values()], c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.rms_norm_eps)
        # the float weights the packed copies replace (fc keeps its own: callers read its dtype and shape)
        release_float_copies([m for la in (self.midlayer, *self.layers.values()) for m in float_copies(la)]
                             + [(self.lm_head_packed, [self.lm_head])])
        return self

    @property
    def weights(self) -> str:
        """The number format its projections run in ("bf16", "q8_0", ...)."""
        from peagle.model.quant import format_of

        return format_of(self.lm_head_packed, self.fc.weight)

    # -- building blocks ---------------------------------------------------------------------------------------
    def new_cache(self, num_slots: int, max_len: int, num_blocks: int | None = None) -> KVCache:
        """As TargetModel.new_cache."""
        p = self.fc.weight
        return KVCache(self.config.num_layers, num_slots, max_len, self.config.num_kv_heads, self.config.head_dim,
                       p.dtype, p.device, num_blocks)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, layout: BatchLayout,
                cache: KVCache | None) -> torch.Tensor:
        """Pre-norm hidden states [B, T, H]. `features` are target features (3*Ht) or fed-back hiddens (H)."""
        h = linear(features, self.fc.weight, packed=self.fc_packed) if features.shape[-1] != self.config.hidden_size \
            else features
        rope = self.rotary(layout.rotary_positions, h.dtype)
        embeds = self.embed_tokens(tokens)
        if cache is not None:
            cache.ensure(layout.slots, layout.positions)
        if self.native_layers is not None and cache is not None and h.dtype == torch.bfloat16 and h.is_cpu:
            slots, positions = layout.slots.to(torch.int64).contiguous(), layout.positions.to(torch.int64).contiguous()
            x, residual = self.midlayer.inputs(embeds, h)
            h = self.native_layers[0].from_input(x.contiguous(), residual.contiguous(), *rope,
                                                 cache.layers[0].reading(layout.keys), slots, positions)
            for i, native in enumerate(self.native_layers[1:], start=1):
                h = native(h, *rope, cache.layers[i].reading(layout.keys), slots, positions)
            return h
        kv = (lambda i: None) if cache is None else (lambda i: cache.layers[i])
        h = self.midlayer(embeds, h, rope, layout, kv(0))
        for i, layer in enumerate(self.layers.values(), start=1):
            h = layer(h, rope, layout, kv(i))
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocab."""
        return linear(self.norm(hidden), self.lm_head.weight, packed=self.lm_head_packed).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy_pick(self, depth: int, logits: torch.Tensor) -> torch.Tensor:
        """The default draft choice: the argmax over the draft vocabulary (logits [B, Vd]) as target ids [B]."""
        return self.to_target_ids(logits.argmax(-1))

    # -- drafting ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_parallel(self, tokens: torch.Tensor, features: torch.Tensor, num_real: torch.Tensor,
                       start: torch.Tensor, slots: torch.Tensor, cache: KVCache, k: int,
                       pick: DraftPick | None = None) -> torch.Tensor:
        """P-EAGLE: all K drafts in one pass.

        tokens [B, R] / features [B, R, 3Ht]: each row's unseen real rows, left-aligned, row b holding num_real[b]
        of them at positions start[b], start[b]+1, ...; returns drafts [B, K] as target ids, chosen depth by depth
        in order by `pick` (default: greedy), so a grammar can mask each depth after the drafts before it.
        """
        if self.mask_hidden is None:
            raise ValueError("this head has no mask_hidden, so it cannot draft in parallel; use method eagle3 with "
                             "parallel_drafting false, or a P-EAGLE head")
        B, R = tokens.shape
        T = R + k - 1
        col = torch.arange(T, device=tokens.device)[None, :].expand(B, T)
        is_real = col < num_real[:, None]
        tok = torch.full((B, T), self.config.mask_token_id, dtype=tokens.dtype, device=tokens.device)
        tok[:, :R] = torch.where(is_real[:, :R], tokens, tok[:, :R])
        feat = self.mask_hidden.to(features.dtype).expand(B, T, -1).clone()
        feat[:, :R] = torch.where(is_real[:, :R, None], features, feat[:, :R])
        # Mask slots follow the last real row; pad rows come after them (their cache writes are stale by design).
        positions = start[:, None] + col
        hidden = self(tok, feat, BatchLayout.build(slots, positions), cache)
        take = (num_real[:, None] - 1 + torch.arange(k, device=tokens.device)[None, :])  # last real + K-1 slots
        out = hidden.gather(1, take[..., None].expand(B, k, hidden.shape[-1]))
        logits, pick = self.logits(out), pick or self.greedy_pick
        return torch.stack([pick(depth, logits[:, depth]) for depth in range(k)], dim=1)

    @torch.inference_mode()
    def draft_chain(self, tokens: torch.Tensor, features: torch.Tensor, num_real: torch.Tensor,
                    start: torch.Tensor, slots: torch.Tensor, cache: KVCache, k: int,
                    pick: DraftPick | None = None) -> torch.Tensor:
        """EAGLE-3: K sequential passes, each feeding back its own pre-norm output and the draft `pick` chose.
        Same inputs as `draft_parallel`."""
        B, R = tokens.shape
        positions = start[:, None] + torch.arange(R, device=tokens.device)[None, :]
        hidden = self(tokens, features, BatchLayout.build(slots, positions), cache)
        last = (num_real - 1)[:, None, None].expand(B, 1, hidden.shape[-1])
        h = hidden.gather(1, last)  # [B, 1, H]
        pos = start + num_real - 1
        drafts, pick = [], pick or self.greedy_pick
        for step in range(k):
            draft = pick(step, self.logits(h)[:, 0])[:, None]  # [B, 1]
            drafts.append(draft)
            if step == k - 1:
                break
            pos = pos + 1
            h = self(draft, h, BatchLayout.build(slots, pos[:, None]), cache)
        return torch.cat(drafts, dim=1)

    @torch.inference_mode()
    def draft_tree(self, tokens: torch.Tensor, features: torch.Tensor, num_real: torch.Tensor,
                   start: torch.Tensor, slots: torch.Tensor, cache: KVCache, k: int, beams: list[int], top: int,
                   pick: DraftPick | None = None) -> tuple[torch.Tensor, list[TreeNodes]]:
        """EAGLE-2's dynamic tree from an EAGLE-3 head, one pass per depth as `draft_chain`. Depth 1 is the root's
        top-`top` children; each next depth is the top-`top` children of request b's beams[b] most probable nodes of
        the depth before (by branch log-probability, the drafted chain's node always among them), all requests'
        beams as rows of one pass. A beam row is rotated as its depth past the last real row and reads the real rows
        and its own ancestors (BatchLayout.tree); it is written at a scratch position past the real rows (depth d's
        j-th beam at last + 1 + (d - 1) * beams[b] + j), which the next catch-up's real rows overwrite or nothing
        reads. Every beam row is its own batch entry, so a request's tree does not depend on its neighbours.

        Same inputs as `draft_chain`; returns the chain `pick` chose [B, K], as draft_chain does, and each request's
        nodes: tokens, parents (-1: the root; parents first), branch log-probabilities, the chain's node per depth."""
        B, R = tokens.shape
        dev = tokens.device
        positions = start[:, None] + torch.arange(R, device=dev)[None, :]
        hidden = self(tokens, features, BatchLayout.build(slots, positions), cache)
        h = hidden.gather(1, (num_real - 1)[:, None, None].expand(B, 1, hidden.shape[-1]))  # [rows, 1, H]
        last, slot_of = (start + num_real - 1).tolist(), slots.tolist()
        trees: list[TreeNodes] = [([], [], [], []) for _ in range(B)]
        written = [{} for _ in range(B)]  # each request's beams: node -> the scratch position its row was written at
        rows = [(b, -1) for b in range(B)]  # whose children this depth's logits give: (request, node; -1 the root)
        chain_rows = list(range(B))
        drafts, pick = [], pick or self.greedy_pick
        for depth in range(k):
            logits = self.logits(h)[:, 0]
            chosen = pick(depth, logits[chain_rows])
            drafts.append(chosen)
            best = torch.log_softmax(logits, dim=-1).topk(min(top, logits.shape[-1]), dim=-1)
            ids, logps, chosen_ids = self.to_target_ids(best.indices).tolist(), best.values.tolist(), chosen.tolist()
            made = [[] for _ in range(B)]  # each request's nodes at this depth: (node, the row whose children)
            for r, (b, node) in enumerate(rows):
                toks, parents, logprobs, chain = trees[b]
                base = logprobs[node] if node >= 0 else 0.0
                children = list(range(len(toks), len(toks) + len(ids[r])))
                toks += ids[r]
                parents += [node] * len(ids[r])
                logprobs += [base + lp for lp in logps[r]]
                if r == chain_rows[b]:
                    hit = next((i for i in children if toks[i] == chosen_ids[b]), None)
                    if hit is None:  # a grammar's pick outside the top candidates: in the tree, never chosen over them
                        hit = len(toks)
                        children.append(hit)
                        toks.append(chosen_ids[b])
                        parents.append(node)
                        logprobs.append(-math.inf)
                    chain.append(hit)
                made[b] += [(i, r) for i in children]
            if depth == k - 1:
                break
            rows, chain_rows, sources, pos, rope, keys = [], [], [], [], [], []
            for b, (toks, parents, logprobs, chain) in enumerate(trees):
                ranked = sorted(made[b], key=lambda m: (-logprobs[m[0]], m[0]))[: beams[b]]
                if all(i != chain[-1] for i, _ in ranked):
                    ranked[-1] = next(m for m in made[b] if m[0] == chain[-1])
                for j, (i, r) in enumerate(ranked):
                    written[b][i] = last[b] + 1 + depth * beams[b] + j
                    branch = [i]
                    while parents[branch[-1]] >= 0:
                        branch.append(parents[branch[-1]])
                    if i == chain[-1]:
                        chain_rows.append(len(rows))
                    rows.append((b, i))
                    sources.append(r)
                    pos.append(written[b][i])
                    rope.append(last[b] + depth + 1)
                    keys.append([0, last[b] + 1, len(branch), *(written[b][a] for a in reversed(branch))])
            layout = BatchLayout.tree(torch.tensor([slot_of[b] for b, _ in rows], device=dev),
                                      torch.tensor(pos, device=dev)[:, None], torch.tensor(rope, device=dev)[:, None],
                                      torch.tensor(keys, dtype=torch.int32, device=dev))
            tok = torch.tensor([trees[b][0][i] for b, i in rows], device=dev)[:, None]
            h = self(tok, h[sources], layout, cache)
        return torch.stack(drafts, dim=1), trees


# One request's dynamic tree (Drafter.draft_tree): node tokens (target ids), parents, branch log-probabilities, and
# the drafted chain's node at each depth.
TreeNodes = tuple[list[int], list[int], list[float], list[int]]


def _hf_rope_config(c: DrafterConfig):
    """A transformers LlamaConfig carrying the RoPE settings, needed only for non-default RoPE types."""
    if c.rope_parameters.get("rope_type", "default") == "default":
        return None
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_heads, head_dim=c.head_dim,
                       max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(c.rope_parameters))
