"""The engine is lossless: speculation never changes what the target says (greedy: token for token; sampling: in
distribution), whatever the drafter, K, batch size or arrival order."""
from __future__ import annotations

import random

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, RequestError, SamplingParams, SpecDecodeStats
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model

MASK_ID = 3


def spec(k: int, parallel: bool) -> SpeculativeConfig:
    return SpeculativeConfig(model="random", num_speculative_tokens=k, parallel_drafting=parallel)


def make_engine(target: TargetModel, k: int = 0, parallel: bool = True, num_layers: int = 1, tokenizer=None,
                max_num_seqs: int = 4, max_model_len: int = 256, seed: int = 0) -> LLMEngine:
    if k == 0:
        return LLMEngine(target, tokenizer, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    head = random_head(target.config, target.embed_tokens.weight, "peagle" if parallel else "eagle3",
                       num_layers=num_layers, mask_token_id=MASK_ID, seed=seed,
                       dtype=target.embed_tokens.weight.dtype)
    return LLMEngine(target, tokenizer, head, spec(k, parallel), max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, speculation_policy="fixed")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> TargetModel:
    path = make_tiny_model(tmp_path_factory.mktemp("engine-tiny"), "llama", seed=1)
    return TargetModel.from_pretrained(path, dtype=torch.float32)


def prompts(n: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def oracle(engine: LLMEngine, reference: dict[tuple, list[int]], wrong_every: int = 3):
    """Wrap the engine's drafting so drafts are the true greedy continuation, except every `wrong_every`-th
    position, which is corrupted: verification, acceptance and KV rollback are exercised at every depth."""
    real_draft = engine.proposer.draft

    def draft(reqs, slots, k, *rest):
        drafts = real_draft(reqs, slots, k, *rest)[0].clone()  # keep the drafter's own cache path running
        for b, req in enumerate(reqs):
            ref = reference[tuple(req.prompt_ids)]
            done = len(req.output_ids)
            for i in range(k):
                j = done + i
                tok = ref[j] if j < len(ref) else 0
                if (j + b) % wrong_every == wrong_every - 1:
                    tok = (tok + 1) % engine.target.config.vocab_size
                drafts[b, i] = tok
        return drafts, None  # the oracle's chains: no candidates to shape trees from

    engine.proposer.draft = draft
    return engine


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3, 7, 11])
def test_greedy_lossless_untrained_heads(tiny_target, k, parallel):
    ps = prompts(8)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = [o.token_ids for o in make_engine(tiny_target, max_num_seqs=8).generate(ps, params)]
    # 8 requests through 3 slots: later requests join mid-flight as earlier ones finish.
    eng = make_engine(tiny_target, k, parallel, num_layers=2, max_num_seqs=3)
    outs = eng.generate(ps, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 7, 20, 13, 20, 1, 20, 20)])
    for o, ref, m in zip(outs, reference, (20, 7, 20, 13, 20, 1, 20, 20)):
        assert o.token_ids == ref[:m]


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_greedy_lossless_with_acceptance(tiny_target, batch, parallel):
    """Drafts that are mostly right: many tokens accepted per step, rollbacks at every depth."""
    ps = prompts(batch, seed=batch)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in make_engine(tiny_target, max_num_seqs=8).generate(ps, params)]
    eng = oracle(make_engine(tiny_target, 5, parallel, max_num_seqs=8), {tuple(p): r for p, r in zip(ps, ref)})
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    assert eng.stats.mean_acceptance_length > 2.0  # acceptance really happened


def test_requests_join_mid_flight(tiny_target):
    ps = prompts(6, seed=7)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = {tuple(p): o.token_ids for p, o in zip(ps, make_engine(tiny_target, max_num_seqs=8).generate(ps, params))}
    eng = oracle(make_engine(tiny_target, 3, True, max_num_seqs=4), ref, wrong_every=4)
    ids, done = {}, {}
    for i, p in enumerate(ps):
        ids[eng.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True))] = p
        for _ in range(i % 3):  # a few steps between arrivals
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert {rid: done[rid] for rid in ids} == {rid: ref[tuple(p)] for rid, p in ids.items()}


def test_abort_leaves_others_unchanged(tiny_target):
    ps = prompts(3, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in make_engine(tiny_target).generate(ps, params)]
    eng = make_engine(tiny_target, 3, True)
    rids = [eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in ps]
    finals = {}
    for _ in range(3):
        eng.step()
    eng.abort(rids[1])
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[rids[1]].finish_reason == "abort"
    assert finals[rids[0]].token_ids == ref[0] and finals[rids[2]].token_ids == ref[2]
    assert sorted(eng.free_slots) == list(range(eng.max_num_seqs)) and eng.num_running == 0


def test_stop_token_and_max_tokens_inside_an_accepted_run(tiny_target):
    p = prompts(1, seed=11)[0]
    ref = make_engine(tiny_target).generate([p], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop_at = next(i for i in range(4, 30) if ref[i] not in ref[:i])
    eng = oracle(make_engine(tiny_target, 7, True), {tuple(p): ref}, wrong_every=100)
    out = eng.generate([p], SamplingParams(max_tokens=30, stop_token_ids=[ref[stop_at]]))[0]
    assert out.token_ids == ref[: stop_at + 1] and out.finish_reason == "stop"
    eng = oracle(make_engine(tiny_target, 7, True), {tuple(p): ref}, wrong_every=100)
    out = eng.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length"
    assert out.spec_stats.num_accepted_tokens >= 4  # the run of 7 was accepted, then cut at 5
    # EOS inside an accepted run stops there, unless ignore_eos.
    eng = oracle(make_engine(tiny_target, 7, True), {tuple(p): ref}, wrong_every=100)
    eng.eos_token_ids = {ref[stop_at]}
    assert eng.generate([p], SamplingParams(max_tokens=30))[0].token_ids == ref[: stop_at + 1]


def test_too_long_request_is_refused(tiny_target):
    eng = make_engine(tiny_target, 3, True, max_model_len=64)
    with pytest.raises(RequestError, match="maximum context length is 64"):
        eng.add_request(list(range(10, 80)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="reduce max_tokens"):
        eng.add_request(list(range(10, 40)), SamplingParams(max_tokens=40))
    with pytest.raises(RequestError, match="token ids must be in"):
        eng.add_request([1, 2, 100000], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    # The engine still serves after refusals, up to the last position.
    out = eng.generate([list(range(10, 40))], SamplingParams(max_tokens=34, ignore_eos=True))[0]
    assert len(out.token_ids) == 34 and out.finish_reason == "length"


def test_parallel_drafting_needs_a_parallel_head(tiny_target):
    head = random_head(tiny_target.config, tiny_target.embed_tokens.weight, "eagle3", dtype=torch.float32)
    with pytest.raises(ValueError, match="mask_hidden"):
        LLMEngine(tiny_target, None, head, spec(3, True))


def test_stats_arithmetic():
    s = SpecDecodeStats(3)
    for accepted in (3, 0, 1, 2):
        s.record(3, accepted)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 12, 6)
    assert s.accepted_per_position == [3, 2, 1]
    assert s.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert s.acceptance_per_position == pytest.approx([0.75, 0.5, 0.25])
    assert s.acceptance_rate == pytest.approx(0.5)
    total = SpecDecodeStats(3)
    total.merge(s)
    total.merge(s)
    assert total.accepted_per_position == [6, 4, 2] and total.mean_acceptance_length == pytest.approx(2.5)


def test_seed_reproducible(tiny_target):
    eng = make_engine(tiny_target, 3, True)
    p = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    a, b = eng.generate([p, p], [params, params])
    assert a.token_ids == b.token_ids
    c = eng.generate([p], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids


@pytest.mark.parametrize("temperature", [1.9e-274, 1e-40, 9e-6])
def test_temperature_too_small_to_divide_by_decodes_greedily(tiny_target, temperature):
    """A positive temperature so small that logits / temperature overflows is greedy decoding (as in vLLM), not a
    NaN distribution."""
    eng = make_engine(tiny_target, 3, True)
    p = prompts(1, seed=6)[0]
    greedy = eng.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    tiny = eng.generate([p], SamplingParams(max_tokens=10, ignore_eos=True, temperature=temperature))[0].token_ids
    assert tiny == greedy


def test_stop_string_truncates_text(tiny_chat_llama):
    from transformers import AutoTokenizer

    target = TargetModel.from_pretrained(tiny_chat_llama, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_chat_llama)
    eng = make_engine(target, 3, True, tokenizer=tok)
    full = eng.generate(["Hello there"], SamplingParams(max_tokens=24, ignore_eos=True), chat=True)[0]
    assert len(full.text) > 10
    stop = full.text[8:11]
    out = eng.generate(["Hello there"], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]), chat=True)[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.find(stop)]
    # Streaming deltas add up to the final text and never leak the stop string.
    deltas = [o.delta_text for o in eng.stream("Hello there", SamplingParams(max_tokens=24, ignore_eos=True,
                                                                           stop=[stop]), chat=True)]
    assert "".join(deltas) == out.text


def test_smollm2_greedy_lossless_untrained_heads(smollm2_dir, one_thread):
    from transformers import AutoTokenizer

    target = TargetModel.from_pretrained(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = ["What is the capital of France?", "Write a Python function that adds two numbers."]
    params = SamplingParams(max_tokens=16)
    ref = [o.token_ids for o in make_engine(target, tokenizer=tok, max_num_seqs=2).generate(msgs, params, chat=True)]
    for parallel in (True, False):
        eng = make_engine(target, 3, parallel, tokenizer=tok, max_num_seqs=2)
        assert [o.token_ids for o in eng.generate(msgs, params, chat=True)] == ref
