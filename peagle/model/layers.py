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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, so bf16 parity holds.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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

    @classmethod
    def build(cls, slots: torch.Tensor, positions: torch.Tensor) -> "BatchLayout":
        kv_len = int(positions.max()) + 1
        keys = torch.arange(kv_len, device=positions.device)
        mask = keys[None, None, :] <= positions[:, :, None]
        B = slots.shape[0]
        contiguous = bool(torch.equal(slots.cpu(), torch.arange(B)))
        return cls(slots, positions, mask[:, None], kv_len, contiguous)

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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: BatchLayout,
                cache_k: torch.Tensor | None, cache_v: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), *rope), apply_rope(k.transpose(1, 2), *rope)
        v = v.transpose(1, 2)  # all [B, heads, T, D] from here
        if cache_k is None:
            keys, values = k, v
        else:
            # Write this step's keys/values into each row's slot at its positions, then attend over the slot.
            slot_idx = layout.slots[:, None].expand(B, T)
            cache_k[slot_idx, :, layout.positions] = k.transpose(1, 2).to(cache_k.dtype)
            cache_v[slot_idx, :, layout.positions] = v.transpose(1, 2).to(cache_v.dtype)
            L = layout.kv_len
            if layout.contiguous:
                keys, values = cache_k[:B, :, :L], cache_v[:B, :, :L]
            else:
                keys, values = cache_k[layout.slots, :, :L], cache_v[layout.slots, :, :L]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=layout.mask,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
