"""Log-probabilities come from the target's own processed distribution at each emitted token: they equal those of a
plain forward over the finished sequence, with and without speculation, greedy and sampled."""
from __future__ import annotations

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.sampling import target_logprobs
from peagle.model.checkpoint import random_head
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model

PROMPTS = [[11, 52, 93, 140, 7], [300, 301, 302, 5, 6, 7, 8, 9, 10, 200, 201]]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TargetModel:
    return TargetModel.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("logprobs-tiny"), "llama", seed=3),
                                       dtype=torch.float32)


def engine(target: TargetModel, k: int) -> LLMEngine:
    if k == 0:
        return LLMEngine(target, max_num_seqs=2, max_model_len=128)
    head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=0,
                       dtype=torch.float32)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=k, parallel_drafting=True)
    return LLMEngine(target, None, head, spec, max_num_seqs=2, max_model_len=128, speculation_policy="fixed")


def teacher_forced_logits(target: TargetModel, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one plain forward over the whole sequence."""
    cache = target.new_cache(1, len(ids) + 4)
    tokens = torch.tensor([ids])
    layout = BatchLayout.build(torch.tensor([0]), torch.arange(len(ids))[None])
    return target(tokens, layout, cache, num_logits=None).logits[0]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=5, prompt_logprobs=3),
                                    SamplingParams(max_tokens=20, ignore_eos=True, logprobs=4, temperature=0.8,
                                                   top_k=30, seed=11)],
                         ids=["greedy", "sampled-top-k"])
@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_targets_processed_distribution(target, params, k, monkeypatch):
    monkeypatch.setattr("peagle.engine.logprobs.PROMPT_LOGPROB_ROWS", 4)  # prompt rows in several blocks
    outs = engine(target, k).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.logprobs) == len(out.token_ids) == 20
        full = prompt + out.token_ids
        ref = target_logprobs(teacher_forced_logits(target, full), params)
        for i, entry in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + i]
            assert entry.token_id == out.token_ids[i]
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
            top_ids = [t for t, _ in entry.top]
            assert len(top_ids) == params.logprobs
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
            assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), row.topk(params.logprobs).values,
                                  atol=1e-4)
            if params.greedy:
                assert top_ids[0] == entry.token_id
            else:
                assert entry.logprob <= entry.top[0][1] + 1e-6 and entry.logprob > -9999.0
        if params.prompt_logprobs is not None:
            raw = torch.log_softmax(teacher_forced_logits(target, prompt), -1)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
                assert entry.token_id == prompt[j]
                assert entry.logprob == pytest.approx(float(raw[j - 1, prompt[j]]), abs=1e-4)
                assert len(entry.top) == params.prompt_logprobs


def test_greedy_logprobs_equal_with_and_without_speculation(target):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    plain = engine(target, 0).generate(PROMPTS, params)
    for k in (1, 4):
        for a, b in zip(plain, engine(target, k).generate(PROMPTS, params)):
            assert a.token_ids == b.token_ids
            assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
            assert [[t for t, _ in e.top] for e in a.logprobs] == [[t for t, _ in e.top] for e in b.logprobs]


def test_stop_token_inside_an_accepted_run_keeps_logprobs_aligned(target):
    full = engine(target, 3).generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = full.token_ids[5]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0, stop_token_ids=[stop])
    out = engine(target, 3).generate([PROMPTS[0]], params)[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    assert all(e.top == () for e in out.logprobs)
