"""The paged KV cache's pool: memory follows the tokens in flight, blocks go back when requests leave, a pool too small
for every running request preempts the newest and computes it again, and none of that changes an output."""
from __future__ import annotations

import random

import pytest
import torch

from peagle.engine import SamplingParams
from peagle.engine.kv_memory import available_memory_bytes, pool_blocks
from peagle.model.layers import KV_BLOCK_SIZE, KVCache, KVCacheFull
from tests.conftest import needs_native_kernels
from tests.test_prefix_cache import engine, reference, same, target  # noqa: F401 (the module's fixture)


_POOL_MEMORY = """
import json, torch
from peagle.model.layers import KV_BLOCK_SIZE, KVCache
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
out, before = {}, rss()
cache = KVCache(8, 4, 4096, 4, 64, torch.bfloat16, num_blocks=2**30 // (8 * 2 * 4 * KV_BLOCK_SIZE * 64 * 2))
out["reserved"] = rss() - before
assert cache.reserve(0, 100 * KV_BLOCK_SIZE)
out["taken"], out["per_block"] = rss() - before, cache.bytes_per_block
cache.release(0)
cache.return_free_pages()
out["returned"] = rss() - before
assert cache.reserve(1, 3 * KV_BLOCK_SIZE)
out["zeros"] = all(float(c[cache.blocks_of(1, 0, 3)].abs().sum()) == 0 for c in (*cache.k, *cache.v))
print(json.dumps(out))
"""


def test_a_pool_costs_memory_only_for_the_blocks_handed_out():
    """A 1 GiB pool is reserved, not written: resident memory grows by the blocks requests take, not the pool. In a
    process of its own: the suite's other allocations move this process's resident memory."""
    import json
    import subprocess
    import sys

    got = json.loads(subprocess.run([sys.executable, "-c", _POOL_MEMORY], capture_output=True, text=True,
                                    check=True).stdout)
    assert got["reserved"] < 64 * 2**20
    assert 100 * got["per_block"] * 0.9 <= got["taken"] < 100 * got["per_block"] + 64 * 2**20
    assert got["returned"] < 64 * 2**20  # as the engine does after start-up's scratch rows
    assert got["zeros"]  # the pages come back as zeros


def test_blocks_are_shared_counted_and_handed_back():
    cache = KVCache(2, 3, 64, 1, 8, torch.bfloat16, num_blocks=6)  # 5 usable blocks
    assert cache.reserve(0, 33)  # 3 blocks
    assert not cache.reserve(1, 48)  # 3 more: only 2 free, and nothing is taken
    assert cache.num_free_blocks == 2
    shared = cache.blocks_of(0, 0, 2)
    cache.adopt(1, 0, shared)  # slot 1 reads slot 0's first two blocks, no copy
    cache.release(0)
    assert cache.num_free_blocks == 3  # its last block went back; the shared two are still slot 1's
    with pytest.raises(KVCacheFull, match="needs 4 more blocks"):
        cache.ensure(torch.tensor([2]), torch.tensor([[63]]))
    cache.release(1)
    assert cache.num_free_blocks == 5


def test_touched_blocks_count_what_was_handed_out_since_the_pool_was_last_all_free():
    """peagle:kv_cache_touched_blocks: the pages a pool holds resident. Start-up's scratch rows do not count once
    return_free_pages gave them back; a block handed out again after that is zeros, as a new one is."""
    cache = KVCache(2, 3, 64, 1, 8, torch.bfloat16, num_blocks=6)
    assert cache.reserve(0, 40) and cache.num_touched_blocks == 3
    cache.k[0][cache.blocks_of(0, 0, 3)] = 1.0
    cache.release(0)
    assert cache.reserve(1, 16) and cache.num_touched_blocks == 3  # a freed block is reused, not a new one
    cache.release(1)
    cache.return_free_pages()
    assert cache.num_touched_blocks == 0
    assert cache.reserve(2, 64) and cache.num_touched_blocks == 4
    assert all(float(c[cache.blocks_of(2, 0, 4)].abs().sum()) == 0 for c in (*cache.k, *cache.v))


def test_pool_size_from_a_budget_or_the_memory_available():
    per_block = 2**20
    assert pool_blocks(per_block, 1000, 10, kv_cache_gb=0.5) == 513
    assert pool_blocks(per_block, 100, 10, kv_cache_gb=0.5) == 100  # never more than every slot's whole context
    assert pool_blocks(per_block, 1000, 10, available=400 * per_block) == 201  # half of what is available
    with pytest.raises(ValueError, match="give --kv-cache-gb at least 0.01 or lower --max-model-len"):
        pool_blocks(per_block, 1000, 11, kv_cache_gb=0.005)
    assert available_memory_bytes() is None or available_memory_bytes() > 0


def test_an_engine_holds_no_blocks_when_idle(target):  # noqa: F811
    eng = engine(target, "peagle", 3, enable_prefix_caching=False)
    usable = eng.target_cache.num_blocks - 1
    assert eng.target_cache.num_free_blocks == usable  # start-up's scratch rows gave theirs back
    eng.generate([[random.Random(0).randrange(20, 500) for _ in range(70)]] * 3,
                 SamplingParams(max_tokens=20, ignore_eos=True))
    assert eng.target_cache.num_free_blocks == usable
    assert eng.drafter_cache.num_free_blocks == usable


POOL_CASES = [(None, 0, True), ("peagle", 3, True), ("peagle", 3, False), ("eagle3", 3, True)]


@needs_native_kernels
@pytest.mark.parametrize("method,k,prefix", POOL_CASES, ids=[f"{m}-k{k}-{'prefix' if p else 'noprefix'}"
                                                             for m, k, p in POOL_CASES])
def test_a_small_pool_preempts_and_changes_no_output(target, method, k, prefix):  # noqa: F811
    """Four requests whose answers outgrow a pool that holds barely more than one request's context: the newest
    running ones give their blocks back and are computed again, and every token and log-probability is what an
    engine with room for all of them gives."""
    rng = random.Random(5)
    prompts = [[rng.randrange(20, 500) for _ in range(rng.randrange(40, 70))] for _ in range(4)]
    params = SamplingParams(max_tokens=120, ignore_eos=True, logprobs=2)
    roomy = reference(target, method, k)
    per_block = roomy.target_cache.bytes_per_block + (roomy.drafter_cache.bytes_per_block if method else 0)
    one_request = KVCache.blocks_for(roomy.capacity)
    small = engine(target, method, k, enable_prefix_caching=prefix, kv_cache_gb=(one_request + 6) * per_block / 2**30)
    assert small.target_cache.num_blocks == one_request + 7
    same(small.generate(prompts, params), roomy.generate(prompts, params))
    assert small.num_preemptions > 0
    assert small.target_cache.num_free_blocks + (small.prefix_cache.num_cached_blocks if prefix else 0) == \
        small.target_cache.num_blocks - 1
