"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, a paged KV cache, attention, MLP, and the
decoder blocks made of them (Llama's, and Gemma's with norms on both sides of attention and MLP).

Every forward works on a batch of B rows with T query tokens each. Row b lives in cache slot `slots[b]`, and its
query i sits at `positions[b, i]`; the cache index of a token *is* its position, so a query attends to every cache
entry at or before its own position in its own slot. A slot's positions lie in blocks of KV_BLOCK_SIZE from one pool,
found through the slot's block table (docs/memory.md, "Paged KV cache"). Entries past a row's accepted length are
stale and are simply overwritten by later writes (speculative rollback costs nothing).
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from peagle.model import kernels, quant


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: "kernels.PackedWeight | None" = None) -> torch.Tensor:
    """F.linear, or peagle's batch-invariant kernel over `packed` (the same weight packed once, see kernels.py) when
    it applies: bf16 on a CPU where a native path runs, no gradients needed."""
    y = kernels.packed_linear(x, packed) if packed is not None else None
    if y is None:
        if weight is None:  # block-quantized: only the packed form exists
            raise RuntimeError(f"a {packed.format} matrix takes bf16 CPU input without gradients; got "
                               f"{x.dtype} on {x.device}")
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and round before the weight, like the reference implementations, so bf16 parity holds.
        y = kernels.rms_norm_bf16(x, self.weight, self.eps)  # one call instead of eight small ops
        if y is not None:
            return y
        return self.weight * torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), in fp32, and rounds once at the end (transformers' Gemma3RMSNorm, op
    for op; each row reduced on its own, so a row's bits never depend on the rows beside it)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rope_inv_freq(rope_parameters: dict, head_dim: int, hf_config=None,
                  layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for a model's RoPE settings.

    Non-default RoPE types (llama3, yarn, linear, ...) are computed by transformers' own init functions from the
    Hugging Face config, so scaled RoPE matches the reference exactly (`layer_type`: the layer kind whose settings
    they read, for a config that keeps settings per kind).
    """
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope_parameters["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hf_config is None or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    with torch.device("cpu"):  # also when called while building a model on the meta device
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", layer_type=layer_type)
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """RoPE on the first `heads` heads (default: all) of x [B, T, heads_total, D], cos/sin [B, T, D]. peagle's kernel
    rotates in place and returns x; otherwise a new tensor comes back."""
    heads = x.shape[2] if heads is None else heads
    if kernels.rope_bf16_(x, cos, sin, heads):
        return x
    r, half = x[:, :, :heads], x.shape[-1] // 2
    cos, sin = cos[:, :, None], sin[:, :, None]
    rotated = r * cos + torch.cat((-r[..., half:], r[..., :half]), dim=-1) * sin
    return rotated if heads == x.shape[2] else torch.cat([rotated, x[:, :, heads:]], dim=2)


_MADV_DONTNEED = 4  # Linux: the pages are dropped, and read as zeros when next touched
KV_BLOCK_SIZE = 16  # positions per block of the KV cache (vLLM's default): the grain of allocation and of prefix reuse
NULL_BLOCK = 0  # all zeros and never handed out: a table entry no block was given points here


class KVCacheFull(RuntimeError):
    """The pool has fewer free blocks than a forward's new positions need (the engine admits and preempts so that it
    never runs such a forward)."""


class LayerKV:
    """One layer's view of a paged cache: key and value pools [num_blocks, nkv, KV_BLOCK_SIZE, D], the block tables
    [num_slots, max_blocks] (int32, shared by every layer), and `key_offset`: every query reads and writes its keys
    that many positions on (where a sliding window starts; window_attention). `native` is the same view as the
    kernels read it, built on first use. `keys`: None, or where each query row of a forward finds its keys when
    they are not simply positions 0..its own (a draft tree: BatchLayout.keys)."""

    __slots__ = ("k", "v", "tables", "key_offset", "keys", "_native")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, key_offset: int = 0,
                 keys: torch.Tensor | None = None):
        self.k, self.v, self.tables, self.key_offset, self.keys, self._native = k, v, tables, key_offset, keys, None

    def moved(self, key_offset: int) -> "LayerKV":
        return LayerKV(self.k, self.v, self.tables, key_offset)

    def reading(self, keys: torch.Tensor | None) -> "LayerKV":
        """This layer's cache for a forward whose rows read the keys `keys` lists (itself when None)."""
        return self if keys is None else LayerKV(self.k, self.v, self.tables, self.key_offset, keys)

    @property
    def native(self):
        if self._native is None:
            self._native = kernels.paged_kv(self.k, self.v, self.tables, self.key_offset, self.keys)
        return self._native

    def gather(self, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 of each slot, contiguous: [B, nkv, length, D] each."""
        blocks = self.tables[slots, : -(-length // KV_BLOCK_SIZE)].long()
        return tuple(c[blocks].transpose(1, 2).flatten(2, 3)[:, :, :length] for c in (self.k, self.v))

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, nkv, D] at each row's positions [B, T] of its slot."""
        blocks = self.tables[slots[:, None].expand_as(positions), positions // KV_BLOCK_SIZE].long()
        self.k[blocks, :, positions % KV_BLOCK_SIZE] = k.to(self.k.dtype)
        self.v[blocks, :, positions % KV_BLOCK_SIZE] = v.to(self.v.dtype)


class KVCache:
    """Keys and values for `num_slots` sequences of up to `max_len` positions, paged: each layer keeps one pool of
    `num_blocks` blocks of KV_BLOCK_SIZE positions (every layer's pools indexed alike), and a slot's block table lists
    the blocks that hold its positions, in order. A forward takes blocks from the pool as its rows reach new
    positions (`ensure`), and `release` gives a slot's back, so memory follows the tokens in flight, not slots times
    context. A block may be held by several holders at once (a slot, the prefix cache: `hold`), and goes back to the
    pool when its last holder lets it go. Blocks are handed out most recently freed first, so the pages a process
    has touched are the ones it reuses. Default `num_blocks`: every slot's whole context, and the null block."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_blocks: int | None = None):
        self.num_slots, self.max_len = num_slots, max_len
        self.max_blocks = -(-max_len // KV_BLOCK_SIZE)
        self.num_blocks = num_blocks or num_slots * self.max_blocks + 1
        if self.num_blocks < 2:
            raise ValueError(f"a KV cache needs at least one block besides the null block; got {self.num_blocks}")
        # torch.empty: a block's pages are committed when it is first handed out (and zeroed then, below)
        shape = (self.num_blocks, num_kv_heads, KV_BLOCK_SIZE, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.tables = torch.full((num_slots, self.max_blocks), NULL_BLOCK, dtype=torch.int32, device=device)
        self.layers = [LayerKV(k, v, self.tables) for k, v in zip(self.k, self.v)]
        self._zero(NULL_BLOCK, NULL_BLOCK + 1)
        self._free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out block 1 first
        self._holders = [0] * self.num_blocks
        self._never_used = NULL_BLOCK + 1  # blocks from here on were never handed out (their memory is not zeroed)
        self._covered = [0] * num_slots  # per slot: table entries from the first that all hold a block
        # called as reclaim(self, n) when fewer than n blocks are free: whoever holds idle blocks (the prefix cache)
        # may let some go
        self.reclaim: Callable[[KVCache, int], None] | None = None

    @property
    def bytes_per_block(self) -> int:
        return 2 * len(self.k) * self.k[0][0].numel() * self.k[0].element_size()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: their pages are committed (resident) until return_free_pages."""
        return self._never_used - NULL_BLOCK - 1

    @staticmethod
    def blocks_for(length: int) -> int:
        """Blocks that hold positions 0..length-1."""
        return -(-length // KV_BLOCK_SIZE)

    def ensure(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Blocks for every position up to each row's last (slots [B], positions [B, T]); KVCacheFull, with nothing
        taken, when the pool has too few."""
        need: dict[int, int] = {}
        for slot, last in zip(slots.tolist(), positions.amax(1).tolist()):
            if last // KV_BLOCK_SIZE >= self._covered[slot]:  # (most forwards stay within blocks already held)
                need[slot] = max(need.get(slot, 0), last + 1)
        missing = {slot: self._missing(slot, length) for slot, length in need.items()}
        if not self._have(sum(len(m) for m in missing.values())):
            raise KVCacheFull(f"the KV cache needs {sum(len(m) for m in missing.values())} more blocks of "
                              f"{KV_BLOCK_SIZE} positions and has {self.num_free_blocks} free")
        for slot, m in missing.items():
            self._fill(slot, m)

    def reserve(self, slot: int, length: int) -> bool:
        """Blocks for positions 0..length-1 of `slot`; False, with nothing taken, when the pool has too few."""
        missing = self._missing(slot, length)
        if not self._have(len(missing)):
            return False
        self._fill(slot, missing)
        return True

    def blocks_missing(self, slot: int, length: int) -> int:
        """Blocks positions 0..length-1 of `slot` still need."""
        return len(self._missing(slot, length))

    def release(self, slot: int) -> None:
        """The slot lets go of all its blocks (those nobody else holds go back to the pool)."""
        for b in self.tables[slot].tolist():
            if b != NULL_BLOCK:
                self.drop(b)
        self.tables[slot] = NULL_BLOCK
        self._covered[slot] = 0

    def blocks_of(self, slot: int, first: int, count: int) -> list[int]:
        """The blocks that hold positions first * KV_BLOCK_SIZE.. of a slot (count of them)."""
        return self.tables[slot, first:first + count].tolist()

    def adopt(self, slot: int, first: int, blocks: list[int]) -> None:
        """Make `blocks`, which someone else holds (the prefix cache), the slot's blocks first, first + 1, ..
        (without a copy; the slot lets go of any it had there)."""
        for i, b in enumerate(blocks):
            self.hold(b)
            old = int(self.tables[slot, first + i])
            if old != NULL_BLOCK:
                self.drop(old)
        self.tables[slot, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self._recount(slot)

    def move(self, slot: int, sources: list[int], destinations: list[int]) -> None:
        """Copy the keys and values at positions `sources` of a slot to `destinations` in every layer (an accepted
        tree branch, written where its nodes were, to where its tokens now sit); every source is read first."""
        src, dst = (torch.tensor(p, device=self.tables.device) for p in (sources, destinations))
        src_blocks, dst_blocks = (self.tables[slot, p // KV_BLOCK_SIZE].long() for p in (src, dst))
        for c in (*self.k, *self.v):
            c[dst_blocks, :, dst % KV_BLOCK_SIZE] = c[src_blocks, :, src % KV_BLOCK_SIZE]

    def hold(self, block: int) -> None:
        self._holders[block] += 1

    def drop(self, block: int) -> None:
        self._holders[block] -= 1
        if self._holders[block] == 0:
            self._free.append(block)

    def holders(self, block: int) -> int:
        return self._holders[block]

    def return_free_pages(self) -> None:
        """Give the pages of every free block back to the operating system (they read as zeros until written
        again): after start-up's scratch forwards, so that idle memory does not grow with the slots they spread
        over. CPU tensors on Linux; a no-op elsewhere."""
        if self.k[0].device.type != "cpu" or not hasattr(os, "sysconf"):
            return
        page, free = os.sysconf("SC_PAGE_SIZE"), sorted(self._free)
        runs, start = [], 0
        for i in range(1, len(free) + 1):  # runs of consecutive free blocks
            if i == len(free) or free[i] != free[i - 1] + 1:
                runs.append((free[start], free[i - 1] + 1))
                start = i
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for t in (*self.k, *self.v):
            per_block = t[0].numel() * t.element_size()
            for first, end in runs:
                lo = -(-(t.data_ptr() + first * per_block) // page) * page
                hi = (t.data_ptr() + end * per_block) // page * page
                if hi > lo:
                    libc.madvise(lo, hi - lo, _MADV_DONTNEED)
        # All free (after start-up's scratch forwards): the pool is as new, so num_touched_blocks counts only what
        # serving commits; every block is zeroed again when next handed out, as a never used one is.
        if len(self._free) == self.num_blocks - 1:
            self._free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))
            self._never_used = NULL_BLOCK + 1

    def _missing(self, slot: int, length: int) -> list[int]:
        """Indices of the slot's table entries below `length` positions that hold no block yet."""
        n = self.blocks_for(min(length, self.max_len))
        if n <= self._covered[slot]:
            return []
        return (self.tables[slot, :n] == NULL_BLOCK).nonzero().flatten().tolist()

    def _have(self, n: int) -> bool:
        """Whether n blocks are free, after asking `reclaim` for them if they are not."""
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(self, n)
        return n <= len(self._free)

    def _fill(self, slot: int, indices: list[int]) -> None:
        if not indices:
            return
        blocks = [self._free.pop() for _ in indices]
        fresh = [b for b in blocks if b >= self._never_used]  # consecutive: the free list hands them out in order
        if fresh:
            self._zero(fresh[0], fresh[-1] + 1)  # no NaN a reused allocation left can reach a masked-out read
            self._never_used = fresh[-1] + 1
        for b in blocks:
            self._holders[b] = 1
        self.tables[slot, indices] = torch.tensor(blocks, dtype=torch.int32)
        self._recount(slot)

    def _recount(self, slot: int) -> None:
        held = (self.tables[slot, self._covered[slot]:] != NULL_BLOCK).tolist()
        self._covered[slot] += held.index(False) if False in held else len(held)

    def _zero(self, first: int, end: int) -> None:
        for c in (*self.k, *self.v):
            c[first:end].zero_()


@dataclass
class BatchLayout:
    """Where each query row of a forward lives: cache slot per row and position per query."""

    slots: torch.Tensor | None  # [B] long; None for a dense (cache-free) forward
    positions: torch.Tensor  # [B, T] long
    dense_mask: torch.Tensor | None = None  # [B, T, T] bool for a dense forward (training)
    # A draft tree's verify forward: each query's rotary position (its depth below x_n, not where it is written) and
    # the cache positions it reads, [B * T, stride] int32 as kernels' peagle_kv.keys (draft_tree.verify_keys)
    rope_positions: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    @classmethod
    def build(cls, slots: torch.Tensor, positions: torch.Tensor) -> "BatchLayout":
        return cls(slots, positions)

    @classmethod
    def tree(cls, slots: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
             keys: torch.Tensor) -> "BatchLayout":
        """Queries written at `positions`, rotated as `rope_positions`, each reading the keys `keys` lists."""
        return cls(slots, positions, None, rope_positions, keys)

    @property
    def rotary_positions(self) -> torch.Tensor:
        return self.positions if self.rope_positions is None else self.rope_positions

    def window_keys(self, window: int | None) -> torch.Tensor | None:
        """`keys` less the keys `window` or more rotary positions before each query (a tree node's branch always
        lies within its window: the branch is shorter than any window)."""
        if self.keys is None or window is None:
            return self.keys
        if window not in self._window_masks:
            keys = self.keys.clone()
            keys[:, 0] = torch.maximum(keys[:, 0], (self.rope_positions.flatten() - window + 1).to(keys.dtype))
            self._window_masks[window] = keys
        return self._window_masks[window]

    def _keys_mask(self, keys: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, L] from per-query key lists: keys first..end-1 and the listed ones."""
        B, T = self.positions.shape
        k = keys.view(B, T, -1).long()
        j = torch.arange(self.kv_len, device=keys.device)
        seen = (j >= k[..., :1]) & (j < k[..., 1:2])
        listed = k[..., 3:]
        valid = torch.arange(listed.shape[-1], device=keys.device) < k[..., 2:3]
        hits = torch.zeros(B, T, self.kv_len, dtype=torch.int32, device=keys.device)
        hits.scatter_add_(-1, torch.where(valid, listed, 0), valid.to(torch.int32))
        return (seen | (hits > 0))[:, None]

    @classmethod
    def dense(cls, positions: torch.Tensor, mask: torch.Tensor) -> "BatchLayout":
        """No cache: queries attend to this forward's own keys under an explicit [B, T, T] mask (training)."""
        return cls(None, positions, mask)

    @cached_property
    def kv_len(self) -> int:
        """Keys a query may read from its slot: positions 0..max(position)."""
        return int(self.positions.max()) + 1

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, T, L]: query may see key. From the cache, key j is visible iff j <= the query's position."""
        if self.dense_mask is not None:
            return self.dense_mask[:, None]
        if self.keys is not None:
            return self._keys_mask(self.keys)
        keys = torch.arange(self.kv_len, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None])[:, None]

    def window_mask(self, window: int | None) -> torch.Tensor:
        """`mask`, less the keys `window` or more positions before the query (sliding-window attention)."""
        if window is None:
            return self.mask
        if self.keys is not None:
            return self._keys_mask(self.window_keys(window))
        if window not in self._window_masks:
            keys = self.positions if self.dense_mask is not None else torch.arange(self.kv_len,
                                                                                   device=self.positions.device)
            recent = keys.expand(self.positions.shape[0], -1)[:, None, :] > self.positions[:, :, None] - window
            self._window_masks[window] = self.mask & recent[:, None]
        return self._window_masks[window]

    @cached_property
    def _window_masks(self) -> dict:
        return {}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BatchLayout, kv: LayerKV | None,
           window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention for q [B, T, nh, D] and this step's k, v [B, T, nkv, D] -> [B, T, nh, D]. With a cache `kv`,
    k and v are first written into each row's slot at its positions, and each query reads its slot up to its
    position (with a `window`: only its last `window` keys, its own included). `scale`: of the scores (default
    1/sqrt(D)).

    peagle's kernel computes every row on its own, so a verify window computes each token exactly as a one-row
    decode step does and speculation stays token-for-token lossless; PyTorch's flash attention (the fallback: GPUs,
    training, CPUs without a native path, a scale other than the kernel's) rounds one query row differently from
    several."""
    native_scale = scale is None or scale == q.shape[-1] ** -0.5
    if kv is not None:
        if native_scale:  # a tree's queries each read the keys they list (windows included)
            out = (window_attention(q, k, v, kv, layout, window) if layout.keys is None else
                   kernels.attention_bf16(q, k, v, kv.reading(layout.window_keys(window)), layout.slots,
                                          layout.positions))
            if out is not None:
                return out
        kv.write(layout.slots, layout.positions, k, v)
        k, v = kv.gather(layout.slots, layout.kv_len)
    else:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=layout.window_mask(window),
                                         enable_gqa=k.shape[1] != q.shape[2], scale=scale)
    return out.transpose(1, 2)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, layout: BatchLayout,
                     window: int | None) -> torch.Tensor | None:
    """peagle's attention kernel over each query's last `window` keys (None: all its keys), or None where the kernel
    does not apply. The kernel reads keys 0..position of a slot; a query whose window starts at key s > 0 runs alone,
    through the slot's table moved s keys on, at position - s. Every query is computed on its own either way, so the
    bits never depend on the rows beside it."""
    positions, slots = layout.positions, layout.slots
    if window is None or int(positions.max()) < window:  # no query has keys outside its window yet
        return kernels.attention_bf16(q, k, v, kv, slots, positions)
    B, T = positions.shape
    out = torch.empty_like(q)
    for b in range(B):
        for t in range(T):
            start = max(0, int(positions[b, t]) - window + 1)
            row = kernels.attention_bf16(q[b:b + 1, t:t + 1], k[b:b + 1, t:t + 1], v[b:b + 1, t:t + 1],
                                         kv.moved(start), slots[b:b + 1], positions[b:b + 1, t:t + 1] - start)
            if row is None:  # the kernel does not apply here (then it did not for the first row either)
                return None
            out[b, t] = row[0, 0]
    return out


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, in_dim: int | None = None,
                 bias: bool = False, qk_norm_eps: float | None = None, norm: type[RMSNorm] = RMSNorm,
                 window: int | None = None, scale: float | None = None):
        """`window`: sliding-window attention over that many keys; `scale`: of the scores (default 1/sqrt(D))."""
        super().__init__()
        in_dim = in_dim or hidden
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.scale = window, scale
        self.q_proj = nn.Linear(in_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        # Qwen3 and Gemma 3 normalise queries and keys per head before RoPE.
        self.q_norm = norm(head_dim, qk_norm_eps) if qk_norm_eps else None
        self.k_norm = norm(head_dim, qk_norm_eps) if qk_norm_eps else None
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)
        self.o_packed = None  # set by pack_()

    @torch.no_grad()
    def pack_(self, path: str | None = None, blocks: dict | None = None, prefix: str = "") -> None:
        """Inference layout: q/k/v as one matrix, and every projection packed for peagle's kernels (`path`: a
        matrix path of kernels.PATHS; default: the machine's fastest). `blocks`: block-quantized matrices by
        name (prefix + "q_proj.weight", ...), packed for the quantized kernels instead (TargetModel.pack_)."""
        self.qkv.pack_(path, blocks, [prefix + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
        self.o_packed = pack_matrix(self.o_proj, path, blocks, prefix + "o_proj.weight")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: BatchLayout,
                kv: LayerKV | None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(B, T, nh + 2 * nkv, self.head_dim)
        if self.q_norm is not None:
            qkv = torch.cat([self.q_norm(qkv[:, :, :nh]), self.k_norm(qkv[:, :, nh:nh + nkv]), qkv[:, :, nh + nkv:]], 2)
        qkv = apply_rope(qkv, *rope, heads=nh + nkv)  # queries and keys in one call
        q, k, v = qkv.split([nh, nkv, nkv], dim=2)
        out = attend(q, k, v, layout, kv, self.window, self.scale)
        return linear(out.reshape(B, T, -1), self.o_proj.weight, self.o_proj.bias, self.o_packed)


class FusedLinear(nn.Module):
    """Several projections of one input as one matrix product (q/k/v, gate/up). The parts keep their own
    parameters (checkpoint names, training); pack_() fuses them into one weight for inference and packs it."""

    def __init__(self, *parts: nn.Linear):
        super().__init__()
        self.parts = parts  # a plain tuple: the parameters stay registered under their owners' names
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.packed = None

    @torch.no_grad()
    def pack_(self, path: str | None = None, blocks: dict | None = None, names: list[str] | None = None) -> None:
        """`blocks` and the parts' `names` in it: when the parts are block-quantized, their blocks are fused."""
        if blocks and names and names[0] in blocks:
            self.packed = quant.fuse([blocks[n] for n in names], self.parts[0].in_features)
            for p in self.parts:
                p.weight = None
            if self.parts[0].bias is not None:
                self.bias = torch.cat([p.bias for p in self.parts])
            return
        weight = torch.cat([p.weight for p in self.parts])
        sizes = [p.weight.shape[0] for p in self.parts]
        for p, w in zip(self.parts, weight.split(sizes)):  # the parts become views: memory does not grow
            p.weight = nn.Parameter(w, requires_grad=False)
        if self.parts[0].bias is not None:
            bias = torch.cat([p.bias for p in self.parts])
            for p, b in zip(self.parts, bias.split(sizes)):
                p.bias = nn.Parameter(b, requires_grad=False)
            self.bias = bias
        self.weight = weight
        self.packed = kernels.PackedWeight.pack(weight, path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None and self.packed is None:  # training: the live parameters (gradients flow to each)
            bias = None if self.parts[0].bias is None else torch.cat([p.bias for p in self.parts])
            return F.linear(x, torch.cat([p.weight for p in self.parts]), bias)
        return linear(x, self.weight, self.bias, self.packed)


def pack_matrix(module: nn.Linear, path: str | None, blocks: dict | None, name: str):
    """One projection packed for the kernels: its block-quantized form when `blocks` has it (the float parameter
    is then dropped), else its bf16 weight packed for `path`."""
    if blocks and name in blocks:
        fmt, data = blocks[name]
        module.weight = None
        return quant.QuantWeight.from_blocks(data, fmt, module.out_features, module.in_features)
    return kernels.PackedWeight.pack(module.weight, path)


def float_copies(layer: nn.Module) -> list[tuple[object, list[nn.Module]]]:
    """A packed decoder layer's matrices, each with the modules holding its float weight (a fused matrix's parts
    hold views of it)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn.qkv.packed, [attn.qkv, *attn.qkv.parts]), (attn.o_packed, [attn.o_proj]),
            (mlp.gate_up.packed, [mlp.gate_up, *mlp.gate_up.parts]), (mlp.down_packed, [mlp.down_proj])]


def release_float_copies(matrices: list[tuple[object, list[nn.Module]]]) -> None:
    """Drop the float weight of each matrix a bf16 packed copy runs (a block-quantized one has none already), for a
    model that will not be trained or saved any more. linear() reads a float weight only where
    kernels.packed_linear refuses the input: not bf16 on the CPU (F.linear would refuse that beside bf16 weights
    too) or needing gradients. Where nothing was packed (no native kernels, a GPU, fp32) the floats stay."""
    for packed, holders in matrices:
        if isinstance(packed, kernels.PackedWeight):
            for module in holders:
                module.weight = None


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = [gate, up]."""
    act = kernels.silu_mul_bf16(gate_up)  # one call instead of three ops
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with GELU's tanh approximation (Gemma), rounding like transformers' ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        self.activation = GATED_ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)
        self.down_packed = None  # set by pack_()

    @torch.no_grad()
    def pack_(self, path: str | None = None, blocks: dict | None = None, prefix: str = "") -> None:
        """Inference layout: gate/up as one matrix, and every projection packed for peagle's kernels."""
        self.gate_up.pack_(path, blocks, [prefix + "gate_proj.weight", prefix + "up_proj.weight"])
        self.down_packed = pack_matrix(self.down_proj, path, blocks, prefix + "down_proj.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.activation(self.gate_up(x))
        return linear(act, self.down_proj.weight, self.down_proj.bias, self.down_packed)


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

    def forward(self, x: torch.Tensor, rope, layout: BatchLayout, kv: LayerKV | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layout, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(nn.Module):
    """Gemma's block: x += norm(attn(norm(x))); x += norm(mlp(norm(x))), under transformers' Gemma 3 names, with a
    family's norm, activation, and this layer's attention window and scale (TargetModel builds it from the config)."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 norm: type[RMSNorm], activation: str, window: int | None, scale: float | None):
        super().__init__()
        self.self_attn = Attention(hidden, num_heads, num_kv_heads, head_dim, qk_norm_eps=eps, norm=norm,
                                   window=window, scale=scale)
        self.mlp = MLP(hidden, intermediate, activation=activation)
        self.input_layernorm = norm(hidden, eps)
        self.post_attention_layernorm = norm(hidden, eps)
        self.pre_feedforward_layernorm = norm(hidden, eps)
        self.post_feedforward_layernorm = norm(hidden, eps)

    def forward(self, x: torch.Tensor, rope, layout: BatchLayout, kv: LayerKV | None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, layout, kv)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
