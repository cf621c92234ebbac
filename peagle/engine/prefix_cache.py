"""Automatic prefix caching: blocks of BLOCK_SIZE tokens whose keys and values (and target features) one request
computed, copied into the cache slot of a later request whose tokens start the same way.

A block is found by a chain of hashes over token ids (block j's key hashes block j-1's key with its own tokens), and
a hit is then checked against the block's own token ids and its parent's identity, so a hash collision can never
hand one request another's context. A block holds, for its BLOCK_SIZE positions:
  - the target's keys and values in every layer,
  - the target features g_t there (what the drafter reads for those rows, so a drafter that has not run them can),
  - and, once the request that stored it had run its drafter over those rows, the drafter's keys and values. The
    drafter's row t reads token x_{t+1}, so its entries depend on the first token after the block as well: the block
    remembers that token, and its drafter entries are used only where the new request has the same one.

Running requests keep their own contiguous cache slot (the attention kernels read one slot per row); blocks are
copies, so none is ever held by a request and any can be evicted: least recently used first, deepest first among
equals, so that a parent never goes before its children. Reuse is bit-exact because the kernels compute each row on
its own: a position's keys and values do not depend on which forward computed them (docs/engine.md, "Prefix caching").
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from peagle.model.layers import KVCache

BLOCK_SIZE = 16  # tokens per block (vLLM's default): the grain of reuse, and of chunk boundaries
DEFAULT_MEMORY_GB = 1.0  # the blocks' memory budget when none is given (--prefix-cache-gb)


@dataclass
class Block:
    uid: int  # never reused, so a child's parent link cannot point at a block that took an evicted one's place
    parent_uid: int | None
    tokens: tuple[int, ...]
    depth: int  # blocks before it in its chain
    index: int  # row in the pool tensors
    next_token: int | None = None  # the token after the block that its drafter entries were computed with
    last_used: int = 0
    salt: str = ""  # a chain's first block: the cache_salt of the requests that may reuse the chain


class PrefixCache:
    """A pool of blocks for one engine: the target's cache layout, the drafter's (or none) and the feature width."""

    def __init__(self, target_cache: KVCache, drafter_cache: KVCache | None, feature_dim: int, memory_gb: float,
                 feature_dtype: torch.dtype):
        caches = [target_cache] + ([drafter_cache] if drafter_cache is not None else [])
        per_block = BLOCK_SIZE * feature_dim * feature_dtype.itemsize + sum(
            2 * math.prod(_block_shape(c)) * c.k[0].element_size() for c in caches)
        self.num_blocks = max(1, int(memory_gb * 2**30) // per_block)
        self.bytes_per_block = per_block
        # torch.empty: pages are committed only as blocks are written
        self.tk, self.tv = _pool(target_cache, self.num_blocks)
        self.dk, self.dv = _pool(drafter_cache, self.num_blocks) if drafter_cache is not None else (None, None)
        self.features = torch.empty((self.num_blocks, BLOCK_SIZE, feature_dim), dtype=feature_dtype,
                                    device=self.tk.device)
        self.blocks: dict[int, Block] = {}  # key -> block
        self._free = list(reversed(range(self.num_blocks)))  # pop() hands out row 0 first
        self._uids = itertools.count()
        self._clock = itertools.count(1)
        self.queries = self.hits = 0  # prompt tokens looked up, and found (vllm:prefix_cache_queries / _hits)

    # -- finding blocks ----------------------------------------------------------------------------------------
    @staticmethod
    def key(parent: Block | None, tokens: tuple[int, ...], salt: str = "") -> int:
        """A chain's first block hashes its salt where later ones hash their parent: chains of different salts
        never meet (vLLM's cache_salt)."""
        return hash((parent.uid if parent is not None else ("salt", salt), tokens))

    def _child(self, parent: Block | None, tokens: tuple[int, ...], salt: str) -> Block | None:
        block = self.blocks.get(self.key(parent, tokens, salt))
        if block is None or block.tokens != tokens or block.parent_uid != (parent.uid if parent else None) \
                or parent is None and block.salt != salt:
            return None  # absent, or a collision
        return block

    def match(self, parent: Block | None, tokens: list[int], max_blocks: int, salt: str = "") -> list[Block]:
        """The blocks that continue `parent`'s chain (None: a chain of `salt`) with tokens[0:BLOCK_SIZE],
        tokens[BLOCK_SIZE:2 BLOCK_SIZE], .. (at most max_blocks), in order."""
        hit, now = [], next(self._clock)
        for j in range(max_blocks):
            block = self._child(parent, tuple(tokens[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]), salt)
            if block is None:
                break
            block.last_used = now
            hit.append(block)
            parent = block
        return hit

    # -- moving entries between a slot and the pool ---------------------------------------------------------------
    def load(self, hit: list[Block], slot: int, start: int, target_cache: KVCache) -> torch.Tensor:
        """Copy the blocks' target entries into `slot` from position `start`; returns their features [rows, F]."""
        idx = torch.tensor([b.index for b in hit], device=self.tk.device)
        _copy_in(self.tk, self.tv, idx, target_cache, slot, start)
        return self.features[idx].flatten(0, 1)

    def load_drafter(self, blocks: list[Block], slot: int, start: int, drafter_cache: KVCache) -> None:
        idx = torch.tensor([b.index for b in blocks], device=self.tk.device)
        _copy_in(self.dk, self.dv, idx, drafter_cache, slot, start)

    def store(self, parent: Block | None, tokens: tuple[int, ...], slot: int, start: int, target_cache: KVCache,
              features: torch.Tensor, salt: str = "") -> Block:
        """The block of `tokens` at positions start.. of `slot` (features [BLOCK_SIZE, F]) after `parent` (None: a
        chain of `salt`): the pool's own if it has one already, else a new one (evicting the least recently used
        block when the pool is full)."""
        block = self._child(parent, tokens, salt)
        if block is not None:
            block.last_used = next(self._clock)
            return block
        index = self._free.pop() if self._free else self._evict()
        block = Block(next(self._uids), parent.uid if parent else None, tokens,
                      parent.depth + 1 if parent else 0, index, last_used=next(self._clock),
                      salt=salt if parent is None else "")
        key = self.key(parent, tokens, salt)
        if key in self.blocks:  # a collision with a different block: the newer one takes the key
            self._free.append(self.blocks.pop(key).index)
        self.blocks[key] = block
        for layer, (k, v) in enumerate(zip(target_cache.k, target_cache.v)):
            self.tk[layer, index] = k[slot, :, start:start + BLOCK_SIZE]
            self.tv[layer, index] = v[slot, :, start:start + BLOCK_SIZE]
        self.features[index] = features
        return block

    def store_drafter(self, block: Block, slot: int, start: int, drafter_cache: KVCache, next_token: int) -> None:
        """The drafter's entries for a block's positions, computed with `next_token` after it."""
        for layer, (k, v) in enumerate(zip(drafter_cache.k, drafter_cache.v)):
            self.dk[layer, block.index] = k[slot, :, start:start + BLOCK_SIZE]
            self.dv[layer, block.index] = v[slot, :, start:start + BLOCK_SIZE]
        block.next_token = next_token

    # -- eviction ------------------------------------------------------------------------------------------------
    def _evict(self) -> int:
        """The pool row of the least recently used block, the deepest first among equals, which leaves the pool."""
        key = min(self.blocks, key=lambda k: (self.blocks[k].last_used, -self.blocks[k].depth))
        return self.blocks.pop(key).index

    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks)


def _copy_in(pool_k: torch.Tensor, pool_v: torch.Tensor, idx: torch.Tensor, cache: KVCache, slot: int,
             start: int) -> None:
    """Pool rows idx ([n] blocks, [L, n, heads, BLOCK_SIZE, D]) into one slot's positions start.. of every layer."""
    n = len(idx)
    for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
        k[slot, :, start:start + n * BLOCK_SIZE] = pool_k[layer, idx].permute(1, 0, 2, 3).flatten(1, 2)
        v[slot, :, start:start + n * BLOCK_SIZE] = pool_v[layer, idx].permute(1, 0, 2, 3).flatten(1, 2)


def _block_shape(cache: KVCache) -> tuple[int, int, int, int]:
    """One block of one of a cache's tensors, every layer: [layers, heads, BLOCK_SIZE, head_dim]."""
    k = cache.k[0]
    return len(cache.k), k.shape[1], BLOCK_SIZE, k.shape[3]


def _pool(cache: KVCache, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values for num_blocks blocks of this cache's layout: [layers, blocks, heads, BLOCK_SIZE, head_dim]."""
    layers, heads, size, dim = _block_shape(cache)
    k = torch.empty((layers, num_blocks, heads, size, dim), dtype=cache.k[0].dtype, device=cache.k[0].device)
    return k, torch.empty_like(k)
