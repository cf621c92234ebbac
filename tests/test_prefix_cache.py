"""Prefix caching and chunked prefill change no output: tokens and log-probabilities of a request served from cached
blocks, or prefilled in chunks between other requests' decode steps, are exactly those of the same request prefilled
from scratch in one pass, with and without speculation, for both heads; no request ever sees another's context."""
from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model, needs_native_kernels

pytestmark = needs_native_kernels  # bit-exact reuse rests on the batch-invariant kernels

# Every method at K 0/3/7, each once with whole prompts and once in 16-token chunks between them.
CASES = [(None, 0, 4096), (None, 0, 16), ("peagle", 3, 16), ("peagle", 7, 4096), ("eagle3", 3, 4096),
         ("eagle3", 7, 16)]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TargetModel:
    path = make_tiny_model(tmp_path_factory.mktemp("prefix-tiny"), "llama", seed=3)
    return TargetModel.from_pretrained(path, dtype=torch.bfloat16)


def engine(target: TargetModel, method: str | None = None, k: int = 0, **options) -> LLMEngine:
    if method is None:
        return LLMEngine(target, None, max_num_seqs=4, max_model_len=256, **options)
    head = random_head(target.config, target.embed_tokens.weight, method, mask_token_id=3, seed=0,
                       dtype=target.embed_tokens.weight.dtype)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=k, parallel_drafting=method == "peagle")
    return LLMEngine(target, None, head, spec, max_num_seqs=4, max_model_len=256, speculation_policy="fixed",
                     **options)


def reference(target: TargetModel, method: str | None = None, k: int = 0) -> LLMEngine:
    """No cache, and every prompt in one pass."""
    return engine(target, method, k, enable_prefix_caching=False, enable_chunked_prefill=False,
                  max_num_batched_tokens=4096)


def shared_prefix_prompts(n: int, shared: int = 70, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(20, 500) for _ in range(shared)]
    return [head + [rng.randrange(20, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


PARAMS = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)


def run_mixed(eng: LLMEngine, ps: list[list[int]]):
    """One after another (each later one hits the earlier ones' blocks), then all together: requests admitted in
    the same step that share a prefix."""
    outs = [eng.generate([p], PARAMS)[0] for p in ps]
    return outs + eng.generate(ps, PARAMS)


def same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [[(x.token_id, x.logprob, x.top) for x in o.logprobs] for o in a] == \
        [[(x.token_id, x.logprob, x.top) for x in o.logprobs] for o in b]


@pytest.mark.parametrize("method,k,budget", CASES, ids=[f"{m}-k{k}-{'chunks' if b < 100 else 'whole'}"
                                                         for m, k, b in CASES])
def test_cached_and_chunked_outputs_equal_one_pass(target, method, k, budget):
    ps = shared_prefix_prompts(3, seed=k)
    want = run_mixed(reference(target, method, k), ps)
    eng = engine(target, method, k, max_num_batched_tokens=budget)
    got = run_mixed(eng, ps)
    same(got, want)
    cached = [o.num_cached_tokens for o in got]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached  # the shared 70 tokens: 4 whole blocks
    assert eng.prefix_cache.hits == sum(cached) and eng.prefix_cache.queries >= sum(len(p) for p in ps)
    # Arriving together at an empty cache: the first prompt's blocks serve the others in the same step (as the
    # choices of n > 1 share their prompt).
    together = engine(target, method, k, max_num_batched_tokens=budget).generate(ps, PARAMS)
    same(together, want[len(ps):])
    assert all(o.num_cached_tokens >= 64 for o in together[1:]), [o.num_cached_tokens for o in together]


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_a_cache_hit_brings_the_drafters_entries(target, method):
    """After a request that drafted, the same prompt finds the drafter's entries too: no catch-up before the first
    draft (the backlog starts past the cached blocks), and the outputs are unchanged."""
    ps = shared_prefix_prompts(1, shared=90, seed=5) * 2
    want = reference(target, method, 3).generate(ps[:1], PARAMS)
    eng = engine(target, method, 3)
    same(eng.generate(ps[:1], PARAMS), want)
    eng.add_request(ps[1], PARAMS)
    eng._take_incoming({})  # the first part of a step: admission and prefill, before any draft
    eng._admit()
    eng.prefill.step(eng.running)
    (req,) = eng.running
    assert req.num_cached_tokens == (len(ps[1]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert req.backlog.start == req.num_cached_tokens  # the drafter's cache holds every cached position
    while eng.has_work():
        outs = eng.step()
    same(outs, want)


def test_multi_turn_history_hits_the_previous_answer(target):
    """A second turn resends the first turn's prompt and answer: both come from the cache."""
    first = shared_prefix_prompts(1, shared=40, seed=9)[0]
    eng, ref = engine(target, "peagle", 3), reference(target, "peagle", 3)
    answer = eng.generate([first], PARAMS)[0].token_ids
    second = first + answer + [37, 38, 39, 40, 41]
    got, want = eng.generate([second], PARAMS), ref.generate([second], PARAMS)
    same(got, want)
    assert got[0].num_cached_tokens == (len(first) + len(answer) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_eviction_under_a_tiny_budget_keeps_outputs(target):
    eng = engine(target, "peagle", 3)
    per_block = eng.prefix_cache.bytes_per_block
    eng = engine(target, "peagle", 3, prefix_cache_gb=5 * per_block / 2**30)
    assert eng.prefix_cache.max_cached_blocks == 5
    ps = shared_prefix_prompts(3, shared=50, seed=11) + shared_prefix_prompts(3, shared=50, seed=12)
    same(run_mixed(eng, ps), run_mixed(reference(target, "peagle", 3), ps))
    assert eng.prefix_cache.num_cached_blocks <= 5


def test_forced_hash_collisions_never_leak_context(target, monkeypatch):
    """Every block hashes alike: a lookup must compare token ids and the parent, so nothing is ever reused for a
    prompt it does not belong to, and outputs stay exact."""
    monkeypatch.setattr(PrefixCache, "key", staticmethod(lambda parent, tokens, salt="": 0))
    ps = shared_prefix_prompts(2, seed=1) + shared_prefix_prompts(2, seed=2)
    eng = engine(target, "peagle", 3)
    same(run_mixed(eng, ps), run_mixed(reference(target, "peagle", 3), ps))
    assert eng.prefix_cache.num_cached_blocks == 1  # one key: each new block replaced the one before
    # ... and a chain's first block is checked against its salt too
    (p,) = shared_prefix_prompts(1, seed=3)
    eng.generate([p], PARAMS, cache_salt="a")
    assert eng.generate([p], PARAMS, cache_salt="b")[0].num_cached_tokens == 0


def test_a_cache_salt_reuses_only_its_own_requests_blocks(target):
    """vLLM's cache_salt: the same prompt under another salt finds nothing (a tenant cannot time another's
    prompts), under the same salt everything, and the outputs are the same either way."""
    (p,) = shared_prefix_prompts(1, shared=60, seed=5)
    eng, ref = engine(target, "peagle", 3), reference(target, "peagle", 3)
    want = ref.generate([p], PARAMS)
    cached = (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
    for salt, hits in (("alice", 0), ("bob", 0), ("alice", cached), ("", 0), ("", cached)):
        got = eng.generate([p], PARAMS, cache_salt=salt)
        same(got, want)
        assert got[0].num_cached_tokens == hits, salt


def test_prompt_logprobs_are_computed_not_skipped(target):
    ps = shared_prefix_prompts(2, seed=4)
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    eng = engine(target, max_num_batched_tokens=32)
    eng.generate(ps[:1], PARAMS)  # cache the shared blocks first
    got, want = eng.generate(ps, params), reference(target).generate(ps, params)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.num_cached_tokens == 0
        assert [(x.token_id, x.logprob) if x else None for x in a.prompt_logprobs] == \
            [(x.token_id, x.logprob) if x else None for x in b.prompt_logprobs]


def test_running_streams_keep_decoding_while_a_long_prompt_prefills(target):
    """Chunked prefill: every step gives the running request a token while a 200-token prompt goes in 32 at a time;
    aborting the long prompt between chunks frees its slot and leaves the stream unchanged."""
    short = [5, 6, 7, 8]
    long = [random.Random(3).randrange(20, 500) for _ in range(200)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = reference(target, "peagle", 3).generate([short], params)[0].token_ids
    eng = engine(target, "peagle", 3, max_num_batched_tokens=32)
    sid = eng.add_request(short, params)
    eng.step()
    lid = eng.add_request(long, params)
    steps_without_a_token = 0
    for _ in range(5):
        outs = {o.request_id: o for o in eng.step()}
        steps_without_a_token += not outs[sid].delta_token_ids
    assert steps_without_a_token == 0
    (long_req,) = [r for r in eng.running if r.request_id == lid]
    assert long_req.prefilling and 0 < long_req.num_computed < len(long)
    eng.abort(lid)
    final = {}
    while eng.has_work():
        final.update({o.request_id: o for o in eng.step()})
    assert final[lid].finish_reason == "abort" and final[sid].token_ids == want
    assert len(eng.free_slots) == eng.max_num_seqs


def test_the_server_reports_cached_tokens_and_hits(tmp_path):
    from tests.serve_util import build_tiny, make_server

    model_dir, head_dir = build_tiny(tmp_path)
    system = "You are a careful assistant. " * 12
    with make_server(model_dir, head_dir) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        usages = [client.chat.completions.create(
            model="tiny", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}]).usage
            for q in ("hello there", "what now?")]
        assert usages[0].prompt_tokens_details.cached_tokens == 0
        assert usages[1].prompt_tokens_details.cached_tokens >= BLOCK_SIZE
        salted = client.chat.completions.create(
            model="tiny", max_tokens=4, temperature=0, extra_body={"cache_salt": "tenant-2"},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]).usage
        assert salted.prompt_tokens_details.cached_tokens == 0  # another salt's blocks are not reused
        server.wait_idle()
        metrics = httpx.get(server.url + "/metrics").text
    hits = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits")]
    assert hits and hits[0] >= usages[1].prompt_tokens_details.cached_tokens
    # the cached blocks are blocks of the KV pool, held while no request runs
    usage = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
    assert usage and 0 < usage[0] < 1
    assert any(line.startswith("vllm:num_preemptions_total") for line in metrics.splitlines())
    # what resident memory is made of: the blocks the pool has handed out, the prefix cache's among them
    gauge = {name: float(line.split()[-1]) for line in metrics.splitlines() for name in
             ("peagle:kv_cache_touched_blocks", "peagle:prefix_cache_blocks", "peagle:proposer_cached_bytes")
             if line.startswith(name + "{")}
    assert gauge["peagle:kv_cache_touched_blocks"] >= gauge["peagle:prefix_cache_blocks"] > 0
    assert gauge["peagle:proposer_cached_bytes"] == 0  # a head keeps nothing across requests (suffix trees do)
    from prometheus_client import generate_latest

    from peagle.serve.metrics import Metrics  # as `peagle serve` shows the pool (the test server shows none)

    shown = Metrics("tiny", server.aengine.engine.k)
    shown.show_cache(server.aengine.engine)
    info = generate_latest(shown.registry).decode()
    assert 'peagle_prefix_block_bytes="' in info and 'peagle_prefix_max_blocks="' in info
