"""Automatic prefix caching: blocks of BLOCK_SIZE positions whose keys and values (and target features) one request
computed, shared by reference with later requests whose tokens start the same way.

A block is found by a chain of hashes over token ids (block j's key hashes block j-1's key with its own tokens), and
a hit is then checked against the block's own token ids and its parent's identity, so a hash collision can never
hand one request another's context. A cached block holds, for its BLOCK_SIZE positions:
  - the target's keys and values in every layer: one block of the target's paged KV cache, which the cache holds a
    reference to (layers.KVCache.hold); a request that hits it puts the same block in its own block table;
  - the target features g_t there (what the drafter reads for those rows, so a drafter that has not run them can),
    kept beside the pool, one row per pool block;
  - and, once the request that stored it had run its drafter over those rows, the block of the drafter's cache that
    holds them. The drafter's row t reads token x_{t+1}, so its entries depend on the first token after the block as
    well: the block remembers that token, and its drafter entries are shared only where the new request has the same
    one.

Nothing is copied: a block's positions are final when it is stored (a request writes only past its committed tokens),
so every holder reads the same bits, and reuse is bit-exact because the kernels compute each row on its own (a
position's keys and values do not depend on which forward computed them; docs/engine.md, "Prefix caching"). The
cache holds at most `memory_gb` of blocks; past that, and whenever the pool runs short of free blocks, it lets go of
the least recently used, the deepest first among equals, so that a parent never goes before its children. A block a
running request also holds stays in that request's table; it returns to the pool when its last holder lets go.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from peagle.model.layers import KV_BLOCK_SIZE, KVCache

BLOCK_SIZE = KV_BLOCK_SIZE  # tokens per cached block: the KV cache's own block (also the grain of chunk boundaries)
DEFAULT_MEMORY_GB = 1.0  # the most the cached blocks may hold when no budget is given (--prefix-cache-gb)


@dataclass
class Block:
    uid: int  # never reused, so a child's parent link cannot point at a block that took an evicted one's place
    parent_uid: int | None
    tokens: tuple[int, ...]
    depth: int  # blocks before it in its chain
    kv: int  # the target cache's block holding its keys and values (and the feature row of the same index)
    drafter_kv: int | None = None  # the drafter cache's block, once its entries were stored
    next_token: int | None = None  # the token after the block that its drafter entries were computed with
    last_used: int = 0
    salt: str = ""  # a chain's first block: the cache_salt of the requests that may reuse the chain


class PrefixCache:
    """The cached blocks of one engine: references into its target cache (and drafter cache, or none), and the
    feature rows beside them."""

    def __init__(self, target_cache: KVCache, drafter_cache: KVCache | None, feature_dim: int, memory_gb: float,
                 feature_dtype: torch.dtype):
        self.target_cache, self.drafter_cache = target_cache, drafter_cache
        caches = [target_cache] + ([drafter_cache] if drafter_cache is not None else [])
        self.bytes_per_block = BLOCK_SIZE * feature_dim * feature_dtype.itemsize + sum(c.bytes_per_block for c in caches)
        self.max_cached_blocks = max(1, int(memory_gb * 2**30) // self.bytes_per_block)
        # torch.empty: a row's pages are committed only when a block's features are written
        self.features = torch.empty((target_cache.num_blocks, BLOCK_SIZE, feature_dim), dtype=feature_dtype,
                                    device=target_cache.k[0].device)
        self.blocks: dict[int, Block] = {}  # key -> block
        self._uids = itertools.count()
        self._clock = itertools.count(1)
        self.queries = self.hits = 0  # prompt tokens looked up, and found (vllm:prefix_cache_queries / _hits)
        for c in caches:
            c.reclaim = self.free_blocks

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

    # -- sharing blocks with a slot ------------------------------------------------------------------------------
    def load(self, hit: list[Block], slot: int, start: int) -> torch.Tensor:
        """Put the blocks in `slot`'s target table from position `start`; returns their features [rows, F]."""
        self.target_cache.adopt(slot, start // BLOCK_SIZE, [b.kv for b in hit])
        return self.features[torch.tensor([b.kv for b in hit])].flatten(0, 1)

    def load_drafter(self, blocks: list[Block], slot: int, start: int) -> None:
        self.drafter_cache.adopt(slot, start // BLOCK_SIZE, [b.drafter_kv for b in blocks])

    def store(self, parent: Block | None, tokens: tuple[int, ...], slot: int, start: int, features: torch.Tensor,
              salt: str = "") -> Block:
        """The block of `tokens` at positions start.. of `slot` (features [BLOCK_SIZE, F]) after `parent` (None: a
        chain of `salt`): the cache's own if it has one already, else the slot's block, now held by the cache too."""
        block = self._child(parent, tokens, salt)
        if block is not None:
            block.last_used = next(self._clock)
            return block
        if len(self.blocks) >= self.max_cached_blocks:
            self._evict()
        kv = self.target_cache.blocks_of(slot, start // BLOCK_SIZE, 1)[0]
        self.target_cache.hold(kv)
        block = Block(next(self._uids), parent.uid if parent else None, tokens, parent.depth + 1 if parent else 0, kv,
                      last_used=next(self._clock), salt=salt if parent is None else "")
        key = self.key(parent, tokens, salt)
        if key in self.blocks:  # a collision with a different block: the newer one takes the key
            self._let_go(self.blocks.pop(key))
        self.blocks[key] = block
        self.features[kv] = features
        return block

    def store_drafter(self, block: Block, slot: int, start: int, next_token: int) -> None:
        """The drafter's entries for a block's positions (in `slot`'s drafter block), computed with `next_token`."""
        block.drafter_kv = self.drafter_cache.blocks_of(slot, start // BLOCK_SIZE, 1)[0]
        self.drafter_cache.hold(block.drafter_kv)
        block.next_token = next_token

    # -- letting go ----------------------------------------------------------------------------------------------
    def free_blocks(self, cache: KVCache, wanted: int) -> None:
        """Let go of least recently used blocks that nothing else holds in `cache` (the target's or the drafter's)
        until it has `wanted` free blocks, or no such block is left: a cache calls this when it runs short."""
        def idle(b: Block) -> bool:
            kv = b.kv if cache is self.target_cache else b.drafter_kv
            return kv is not None and cache.holders(kv) == 1

        if cache.num_free_blocks >= wanted:
            return
        candidates = sorted((k for k, b in self.blocks.items() if idle(b)),
                            key=lambda k: (self.blocks[k].last_used, -self.blocks[k].depth))
        for key in candidates:  # one pass, however many blocks must go
            self._let_go(self.blocks.pop(key))
            if cache.num_free_blocks >= wanted:
                return

    def num_idle_blocks(self, cache: KVCache) -> int:
        """Blocks of `cache` that only the prefix cache holds (free_blocks could let them go)."""
        if cache is self.target_cache:
            return sum(cache.holders(b.kv) == 1 for b in self.blocks.values())
        return sum(b.drafter_kv is not None and cache.holders(b.drafter_kv) == 1 for b in self.blocks.values())

    def _evict(self) -> None:
        """The least recently used block, the deepest first among equals, leaves the cache."""
        key = min(self.blocks, key=lambda k: (self.blocks[k].last_used, -self.blocks[k].depth))
        self._let_go(self.blocks.pop(key))

    def _let_go(self, block: Block) -> None:
        self.target_cache.drop(block.kv)
        if block.drafter_kv is not None:
            self.drafter_cache.drop(block.drafter_kv)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.blocks)
