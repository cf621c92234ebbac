"""Model-free drafts (ngram, suffix) and the hybrid are lossless: greedy output equals plain decoding token for
token, with requests joining mid-flight, under both policies; and their drafts really are accepted on text that
repeats (so these tests can fail)."""
from __future__ import annotations

import random

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TargetModel:
    return TargetModel.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("proposers"), "llama", seed=1),
                                       dtype=torch.float32)


def repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 512) for _ in range(rng.randrange(6, 14))] * 3 for _ in range(n)]


def run_joining(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Half the prompts first; the rest join while the first ones decode."""
    ids = [engine.add_request(p, params) for p in prompts[: len(prompts) // 2]]
    final: dict[str, list[int]] = {}
    for _ in range(3):
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    ids += [engine.add_request(p, params) for p in prompts[len(prompts) // 2:]]
    while engine.has_work():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [final[i] for i in ids]


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "hybrid"])
def test_greedy_lossless_and_accepted(target, method, policy):
    ps, params = repeating_prompts(6), SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(target, None, max_num_seqs=4, max_model_len=256).generate(ps, params)]
    head = None
    if method == "hybrid":
        head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=0,
                           dtype=target.embed_tokens.weight.dtype)
    spec = SpeculativeConfig(method=method, model="random" if head is not None else None)
    engine = LLMEngine(target, None, head, spec, max_num_seqs=4, max_model_len=256, speculation_policy=policy)
    assert run_joining(engine, ps, params) == ref
    model_free = "ngram" if method == "ngram" else "suffix"
    assert engine.proposer_stats[model_free].num_accepted_tokens > 0, engine.proposer_stats
    if method == "hybrid" and policy == "fixed":  # where the tree has no draft, the head drafts
        assert engine.proposer_stats["peagle"].num_drafts > 0


def test_the_hybrid_without_a_head_keeps_its_suffix_drafts(target):
    """A model with no head (any model but the embedded one) still gets the hybrid's suffix drafts, losslessly."""
    ps, params = repeating_prompts(3, seed=2), SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(target, None, max_num_seqs=4, max_model_len=256).generate(ps, params)]
    engine = LLMEngine(target, None, None, SpeculativeConfig(method="hybrid"), max_num_seqs=4, max_model_len=256)
    assert engine.spec.method == "suffix" and engine.drafter is None
    assert [o.token_ids for o in engine.generate(ps, params)] == ref
    assert engine.proposer_stats["suffix"].num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_a_long_prompt_is_indexed_a_chunk_at_a_time(target, method):
    """The suffix tree takes each prefilled chunk in the step that computed it (under that step's budget), not the
    whole prompt at the first decode step; the drafts are the same either way (lossless, and accepted)."""
    prompt = repeating_prompts(1, seed=4)[0] * 4
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = LLMEngine(target, None, max_num_seqs=2, max_model_len=256).generate([prompt], params)[0].token_ids
    head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=0,
                       dtype=target.embed_tokens.weight.dtype) if method == "hybrid" else None
    engine = LLMEngine(target, None, head, SpeculativeConfig(method=method, model="random" if head else None),
                       max_num_seqs=2, max_model_len=256, max_num_batched_tokens=32)
    suffix = engine.proposer.suffix if method == "hybrid" else engine.proposer
    rid = engine.add_request(prompt, params)
    indexed = []
    while engine.running or engine.waiting or not indexed:
        outs = engine.step()
        req = next((r for r in engine.running if r.request_id == rid), None)
        if req is not None and req.prefilling:
            indexed.append((suffix.cache.num_tokens(rid), req.num_computed))
        if outs and outs[0].finished:
            assert outs[0].token_ids == ref
            break
    assert len(indexed) >= 2 and all(have == done for have, done in indexed), indexed
    assert engine.proposer_stats["suffix"].num_accepted_tokens > 0


def test_shared_suffix_trees_are_kept_per_cache_salt(target):
    """Finished outputs join the shared tree of their credential and salt only: requests of another salt never
    draft from them."""
    ps, params = repeating_prompts(2, seed=6), SamplingParams(max_tokens=12, ignore_eos=True)
    engine = LLMEngine(target, None, None, SpeculativeConfig(method="suffix"), max_num_seqs=2, max_model_len=256)
    engine.generate(ps, params, cache_salt="run-1")
    engine.generate(ps[:1], params, cache_salt="run-2")
    assert sorted(engine.proposer.cache._shared) == ["/run-1", "/run-2"]
    assert [t.outputs for _, t in sorted(engine.proposer.cache._shared.items())] == [2, 1]
    # what the server shows as peagle:proposer_cached_bytes: the shared trees, nothing of the finished requests
    assert engine.proposer.cached_bytes() == engine.proposer.cache.memory_bytes() > 0


def test_prompt_lookup_lengths_are_bounded():
    with pytest.raises(ValueError, match="between 1 and 64"):
        SpeculativeConfig(method="ngram", prompt_lookup_max=1000)
