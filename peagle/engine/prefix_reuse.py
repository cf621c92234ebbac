"""What a request takes from the prefix cache and gives to it (the cache itself: prefix_cache.py). A prompt continues
from the longest run of cached blocks it matches; every block a request completes, in its prompt or its output, goes
into the cache; and when the request leaves, the drafter's entries of its blocks go too, so that a later request
with the same prefix finds the drafter caught up as well."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from peagle.engine.catch_up import DrafterCatchUp
from peagle.engine.prefix_cache import BLOCK_SIZE, PrefixCache

if TYPE_CHECKING:
    from peagle.engine.request import Request


class PrefixReuse:
    def __init__(self, cache: PrefixCache | None, catch_up: DrafterCatchUp):
        """`cache` None: prefix caching is off, and every method does nothing."""
        self.cache, self.catch_up = cache, catch_up

    def continue_prompt(self, req: Request) -> None:
        """Take the prompt's next positions from the prefix cache, whole blocks while they match (never the last
        prompt token: its logits give the first token). Where the drafter is caught up and a block has the
        drafter's entries for the same next token, those are copied too; otherwise the block's features wait for
        the drafter like computed rows. A request that wants prompt log-probabilities computes every position."""
        pc, start = self.cache, req.num_computed
        if pc is None or req.params.prompt_logprobs is not None or start != len(req.blocks) * BLOCK_SIZE:
            return
        ids = req.prefill_ids
        m = len(ids)
        hit = pc.match(req.blocks[-1] if req.blocks else None, ids[start:], (m - 1 - start) // BLOCK_SIZE,
                       req.cache_salt)
        if not hit:
            return
        end = start + len(hit) * BLOCK_SIZE
        features = pc.load(hit, req.slot, start)
        if self.catch_up.drafts_later(req):
            reused = 0
            if not req.backlog.tokens and req.backlog.start == start:
                for j, block in enumerate(hit):
                    if block.next_token != ids[start + (j + 1) * BLOCK_SIZE]:
                        break
                    reused = j + 1
            if reused:
                pc.load_drafter(hit[:reused], req.slot, start)
                req.backlog.skip(reused * BLOCK_SIZE)
            mid = start + reused * BLOCK_SIZE
            if mid < end:
                req.backlog.append(ids[mid + 1:end + 1], features[mid - start:])
        req.blocks += hit
        req.num_computed = req.num_cached_tokens = end
        pc.hits += end - start

    def store_blocks(self, req: Request, features: torch.Tensor) -> None:
        """Positions that just got their final keys and values (features [n, F], right after those before): every
        block they complete goes into the prefix cache."""
        pc = self.cache
        if pc is None:
            return
        req.unstored_features.append(features)
        have = sum(len(f) for f in req.unstored_features)
        if have < BLOCK_SIZE:
            req.unstored_features = [torch.cat(req.unstored_features)]  # a copy: not a view of the step's batch
            return
        feats, seq, start = torch.cat(req.unstored_features), req.prompt_ids + req.output_ids, len(req.blocks) * BLOCK_SIZE
        full = have // BLOCK_SIZE
        for j in range(full):
            p = start + j * BLOCK_SIZE
            req.blocks.append(pc.store(req.blocks[-1] if req.blocks else None, tuple(seq[p:p + BLOCK_SIZE]),
                                       req.slot, p, feats[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE], req.cache_salt))
        rest = feats[full * BLOCK_SIZE:]
        req.unstored_features = [rest.clone()] if len(rest) else []

    def store_drafter_entries(self, req: Request) -> None:
        """Before a request's slot is freed: the drafter's blocks of its cached blocks that it has run (and that
        no request has given yet), with the token after each block that they were computed with."""
        if self.cache is None or self.cache.drafter_cache is None:
            return
        seq = req.prompt_ids + req.output_ids
        for j, block in enumerate(req.blocks):
            p = j * BLOCK_SIZE
            if p + BLOCK_SIZE > req.backlog.start or p + BLOCK_SIZE >= len(seq):
                break
            if block.next_token is None and block.tokens == tuple(seq[p:p + BLOCK_SIZE]):
                self.cache.store_drafter(block, req.slot, p, seq[p + BLOCK_SIZE])
