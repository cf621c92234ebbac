"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, a per-row KV cache, attention, MLP.

Every forward works on a batch of B rows with T query tokens each. Row b lives in cache slot `slots[b]`, and its
query i sits at `positions[b, i]`; the cache index of a token *is* its position, so a query attends to every cache
entry at or before its own position in its own slot. Entries past a row's accepted length are stale and are simply
overwritten by later writes (speculative rollback costs nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peagle.model import kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: "kernels.PackedWeight | None" = None) -> torch.Tensor:
    """F.linear, or peagle's batch-invariant AMX kernel over `packed` (the same weight packed once, see
    kernels.py) when it applies: bf16 on a CPU with AMX, no gradients needed."""
    y = kernels.packed_linear(x, packed) if packed is not None else None
    if y is None:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and round before the weight, like the reference implementations, so bf16 parity holds.
        if x.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            y = kernels.rms_norm_bf16(x, self.weight, self.eps)  # one call instead of eight small ops
            if y is not None:
                return y
        return self.weight * torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def rope_inv_freq(rope_parameters: dict, head_dim: int, hf_config=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for a model's RoPE settings.

    Non-default RoPE types (llama3, yarn, linear, ...) are computed by transformers' own init functions from the
    Hugging Face config, so scaled RoPE matches the reference exactly.
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope_parameters["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hf_config is None or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    with torch.device("cpu"):  # also when called while building a model on the meta device
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, D]; cos/sin: [B, T, D]
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_heads_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope for x laid out [B, T, heads, D] (cos/sin [B, T, D]), the layout projections come out in."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """Keys and values for `num_slots` sequences of up to `max_len` positions, one pair of tensors per layer."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len


@dataclass
class BatchLayout:
    """Where each query row of a forward lives: cache slot per row and position per query."""

    slots: torch.Tensor | None  # [B] long; None for a dense (cache-free) forward
    positions: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, 1, T, L] bool: query may see key
    kv_len: int  # L: keys read from the cache
    contiguous: bool  # slots == arange(B): read the cache as a view, no gather
    # When every row's positions are one run start, start+1, ...: (slot, start) per row, so cache writes are slice
    # copies instead of an index_put (a fixed cost per layer that matters when decoding one token).
    row_ranges: list[tuple[int, int]] | None = None

    @classmethod
    def build(cls, slots: torch.Tensor, positions: torch.Tensor) -> "BatchLayout":
        kv_len = int(positions.max()) + 1
        keys = torch.arange(kv_len, device=positions.device)
        mask = keys[None, None, :] <= positions[:, :, None]
        B, T = positions.shape
        slot_list = slots.tolist()
        contiguous = slot_list == list(range(B))
        row_ranges = None
        if T == 1 or bool((positions[:, 1:] - positions[:, :-1] == 1).all()):
            row_ranges = list(zip(slot_list, positions[:, 0].tolist()))
        return cls(slots, positions, mask[:, None], kv_len, contiguous, row_ranges)

    @classmethod
    def dense(cls, positions: torch.Tensor, mask: torch.Tensor) -> "BatchLayout":
        """No cache: queries attend to this forward's own keys under an explicit [B, T, T] mask (training)."""
        return cls(None, positions, mask[:, None], positions.shape[1], False)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, in_dim: int | None = None,
                 bias: bool = False, qk_norm_eps: float | None = None):
        super().__init__()
        in_dim = in_dim or hidden
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        # Qwen3 normalises queries and keys per head before RoPE.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps else None

        # Set by fuse_(): the q, k, v projections as one matrix (non-persistent: never in a state_dict).
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        # Set by pack_(): the same weights packed for the AMX kernel (kernels.PackedWeight, CPU bf16 only).
        self.qkv_packed = self.o_packed = None

    @torch.no_grad()
    def fuse_(self) -> None:
        """Inference only: put q/k/v weights in one matrix (one matmul instead of three). The q/k/v parameters
        become views of it, so memory does not grow and state_dict names stay the same."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        fused = torch.cat([p.weight for p in parts])
        sizes = [p.weight.shape[0] for p in parts]
        for p, w in zip(parts, fused.split(sizes)):
            p.weight = nn.Parameter(w, requires_grad=False)
        self.qkv_weight = fused
        if self.q_proj.bias is not None:
            bias = torch.cat([p.bias for p in parts])
            for p, b in zip(parts, bias.split(sizes)):
                p.bias = nn.Parameter(b, requires_grad=False)
            self.qkv_bias = bias

    @torch.no_grad()
    def pack_(self) -> None:
        """Inference only: pack q/k/v (as one matrix) and o for the AMX kernel; a no-op where it is unavailable.
        The packed copies do not follow later changes to the parameters."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        w = self.qkv_weight if self.qkv_weight is not None else torch.cat([p.weight for p in parts])
        self.qkv_packed = kernels.PackedWeight.pack(w)
        self.o_packed = kernels.PackedWeight.pack(self.o_proj.weight)
        if self.qkv_packed is not None and self.qkv_bias is None and self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([p.bias for p in parts])

    def _qkv(self, x: torch.Tensor) -> torch.Tensor | None:
        """The three projections as one [.., (nh + 2 nkv) * D] tensor when fused or packed, else None."""
        y = kernels.packed_linear(x, self.qkv_packed) if self.qkv_packed is not None else None
        if y is not None:
            return y if self.qkv_bias is None else y + self.qkv_bias
        if self.qkv_weight is not None:
            return F.linear(x, self.qkv_weight, self.qkv_bias)
        return None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: BatchLayout,
                cache_k: torch.Tensor | None, cache_v: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv(x)
        if qkv is not None and self.q_norm is None:
            # One projection, then RoPE on queries and keys together: [B, T, nh + nkv, D].
            qkv = qkv.view(B, T, nh + 2 * nkv, D)
            if kernels.rope_bf16_(qkv, *rope, heads=nh + nkv):  # in place, one call
                qk = qkv[:, :, :nh + nkv].transpose(1, 2)
            else:
                qk = _rope_heads_last(qkv[:, :, :nh + nkv], *rope).transpose(1, 2)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, :, nh + nkv:].transpose(1, 2)
        else:
            if qkv is not None:
                q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(B, T, nh, D), k.view(B, T, nkv, D), v.view(B, T, nkv, D)
            if self.q_norm is not None:  # Qwen3 normalises queries and keys per head before RoPE
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q.transpose(1, 2), *rope), apply_rope(k.transpose(1, 2), *rope)
            v = v.transpose(1, 2)  # all [B, heads, T, D] from here
        out = None
        if cache_k is not None:
            # Write this step's keys/values into each row's slot at its positions, then attend over the slot.
            ranges = layout.row_ranges
            if ranges is not None and layout.contiguous and all(r[1] == ranges[0][1] for r in ranges):
                start = ranges[0][1]
                cache_k[:B, :, start:start + T] = k
                cache_v[:B, :, start:start + T] = v
            elif ranges is not None and B <= 8:
                for b, (slot, start) in enumerate(ranges):
                    cache_k[slot, :, start:start + T] = k[b]
                    cache_v[slot, :, start:start + T] = v[b]
            else:
                slot_idx = layout.slots[:, None].expand(B, T)
                cache_k[slot_idx, :, layout.positions] = k.transpose(1, 2).to(cache_k.dtype)
                cache_v[slot_idx, :, layout.positions] = v.transpose(1, 2).to(cache_v.dtype)
            # peagle's kernel computes every row on its own, so a verify window computes each token exactly as a
            # one-row decode step does (speculation stays token-for-token lossless); PyTorch's flash attention
            # rounds differently for one query row than for several. It applies BatchLayout.build's mask (key j
            # visible iff j <= the query's position) from the positions themselves.
            out = kernels.attention_bf16(q.transpose(1, 2), cache_k, cache_v, layout.slots, layout.positions)
        if out is None:
            if cache_k is None:
                keys, values = k, v
            elif layout.contiguous:
                keys, values = cache_k[:B, :, :layout.kv_len], cache_v[:B, :, :layout.kv_len]
            else:
                keys, values = cache_k[layout.slots, :, :layout.kv_len], cache_v[layout.slots, :, :layout.kv_len]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=layout.mask, enable_gqa=nkv != nh)
            out = out.transpose(1, 2)  # [B, T, nh, D]
        return linear(out.reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias, self.o_packed)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

        self.register_buffer("gate_up_weight", None, persistent=False)  # set by fuse_()
        self.gate_up_packed = self.down_packed = None  # set by pack_()

    @torch.no_grad()
    def fuse_(self) -> None:
        """Inference only: gate and up projections in one matrix; their parameters become views of it."""
        if self.gate_proj.bias is not None:
            return
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        gate, up = fused.split([self.gate_proj.weight.shape[0], self.up_proj.weight.shape[0]])
        self.gate_proj.weight = nn.Parameter(gate, requires_grad=False)
        self.up_proj.weight = nn.Parameter(up, requires_grad=False)
        self.gate_up_weight = fused

    @torch.no_grad()
    def pack_(self) -> None:
        """Inference only: pack gate/up (as one matrix) and down for the AMX kernel (no-op where unavailable)."""
        if self.gate_proj.bias is not None:
            return
        w = self.gate_up_weight if self.gate_up_weight is not None else torch.cat(
            [self.gate_proj.weight, self.up_proj.weight])
        self.gate_up_packed = kernels.PackedWeight.pack(w)
        self.down_packed = kernels.PackedWeight.pack(self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = kernels.packed_linear(x, self.gate_up_packed) if self.gate_up_packed is not None else None
        if gate_up is None and self.gate_up_weight is not None:
            gate_up = F.linear(x, self.gate_up_weight)
        if gate_up is not None:
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias, self.down_packed)


class DecoderLayer(nn.Module):
    """A pre-norm Llama block. With `attn_in_dim = 2 * hidden` it is the drafter's fusion layer (see drafter.py)."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, attention_bias: bool = False, qk_norm: bool = False, attn_in_dim: int | None = None):
        super().__init__()
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, in_dim=attn_in_dim,
                                   bias=attention_bias, qk_norm_eps=eps if qk_norm else None)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rope, layout: BatchLayout, cache_k, cache_v) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, cache_k, cache_v)
        return x + self.mlp(self.post_attention_layernorm(x))
