"""Speculative sampling keeps the target's distribution: a chi-square test against the exact distribution of
continuations on a tiny model with an 8-token vocab, and proof that the test catches a biased acceptance rule."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine import engine as engine_module
from peagle.engine.sampling import target_probs
from peagle.model.checkpoint import random_head
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model

VOCAB, PROMPT, NEW, SAMPLES = 8, [5, 1, 7, 4, 6], 3, 3000


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory) -> TargetModel:
    path = make_tiny_model(tmp_path_factory.mktemp("vocab8"), "llama", seed=3, vocab_size=VOCAB, bos_token_id=0,
                           eos_token_id=0, pad_token_id=0)
    model = TargetModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # sharpen the random logits a little so the distribution is far from uniform
        model.lm_head_weight.mul_(8.0)
    return model


def exact_joint(target: TargetModel, params: SamplingParams) -> dict[tuple, float]:
    """P(t2, t3 | prompt), marginalising t1, from the processed target distribution."""
    cache = target.new_cache(1, 32)

    def probs(prefix: list[int]) -> torch.Tensor:
        n = len(prefix)
        out = target(torch.tensor([prefix]), BatchLayout.build(torch.tensor([0]), torch.arange(n)[None]), cache)
        return target_probs(out.logits[0, -1], params)

    joint: dict[tuple, float] = {}
    p1 = probs(PROMPT)
    for t1 in range(VOCAB):
        if p1[t1] == 0:
            continue
        p2 = probs(PROMPT + [t1])
        for t2 in range(VOCAB):
            if p2[t2] == 0:
                continue
            p3 = probs(PROMPT + [t1, t2])
            for t3 in range(VOCAB):
                joint[(t2, t3)] = joint.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return joint


def sample_joint(engine: LLMEngine, params: SamplingParams, **fields) -> dict[tuple, int]:
    """Counts of tokens 2-3 over SAMPLES seeded requests (`fields`: more SamplingParams, e.g. a constraint)."""
    fields = {"ignore_eos": True, **fields}
    plist = [SamplingParams(max_tokens=NEW, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            seed=i, **fields) for i in range(SAMPLES)]
    counts: dict[tuple, int] = {}
    for out in engine.generate([PROMPT] * SAMPLES, plist):
        key = tuple(out.token_ids[1:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_rejects(counts: dict[tuple, int], exact: dict[tuple, float], alpha_z: float = 3.09) -> tuple[bool, float, float]:
    """Pearson chi-square with bins of expected count < 5 pooled; critical value at alpha = 1e-3
    (Wilson-Hilferty). Any sample in a zero-probability bin rejects."""
    if any(k not in exact or exact[k] == 0 for k in counts):
        return True, math.inf, 0.0
    n = sum(counts.values())
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for k, p in exact.items():
        e = n * p
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(k, 0), pooled_exp + e
            continue
        stat += (counts.get(k, 0) - e) ** 2 / e
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    df = bins - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit, stat, crit


def spec_engine(target: TargetModel, k: int, exact: dict[tuple, float]) -> LLMEngine:
    """A P-EAGLE engine whose drafts are the most likely token at each output position (marginally), so drafts
    are often accepted and often rejected: both branches of the rejection sampler carry weight."""
    head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=1,
                       dtype=torch.float32)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=k, parallel_drafting=True)
    engine = LLMEngine(target, None, head, spec, max_num_seqs=256, max_model_len=32, speculation_policy="fixed",
                       max_num_batched_tokens=2048)  # every sample admitted in the first step
    marginal2 = [sum(p for (a, _), p in exact.items() if a == t) for t in range(VOCAB)]
    marginal3 = [sum(p for (_, b), p in exact.items() if b == t) for t in range(VOCAB)]
    modes = {1: max(range(VOCAB), key=marginal2.__getitem__), 2: max(range(VOCAB), key=marginal3.__getitem__)}
    real_draft = engine.proposer.draft

    def draft(reqs, slots, window, *rest):
        drafts = real_draft(reqs, slots, window, *rest)[0].clone()
        for b, req in enumerate(reqs):
            for i in range(window):
                drafts[b, i] = modes.get(len(req.output_ids) + i, 0)
        return drafts, None  # the oracle's chains: no candidates to shape trees from

    engine.proposer.draft = draft
    return engine


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_p=0.9, top_k=6)],
                         ids=["t1.0", "t0.7-topp0.9-topk6"])
def test_speculative_sampling_matches_target_distribution(small_vocab_target, params):
    exact = exact_joint(small_vocab_target, params)
    engine = spec_engine(small_vocab_target, 3, exact)
    counts = sample_joint(engine, params)
    rate = engine.stats.acceptance_per_position
    assert rate[0] > 0.2 and rate[1] > 0.05, rate  # drafts really were accepted, at more than one depth
    rejects, stat, crit = chi_square_rejects(counts, exact)
    assert not rejects, f"chi2 {stat:.1f} > critical {crit:.1f}: speculation changed the distribution"


def biased_verify(tree, probs, generator):
    """A wrong rule: on rejection, resample from p without removing the rejected draft."""
    path, row = [], 0
    for i, d in enumerate(tree.tokens):  # a chain: node i at depth i + 1
        if float(torch.rand(1, generator=generator)) < float(probs[i, d]):
            path.append(i)
            continue
        return path, [tree.tokens[j] for j in path] + [int(torch.multinomial(probs[i], 1, generator=generator))]
    return path, list(tree.tokens) + [int(torch.multinomial(probs[-1], 1, generator=generator))]


def test_the_test_catches_a_biased_acceptance_rule(small_vocab_target, monkeypatch):
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(small_vocab_target, params)
    monkeypatch.setattr(engine_module, "verify_sampled", biased_verify)
    rejects, stat, crit = chi_square_rejects(sample_joint(spec_engine(small_vocab_target, 3, exact), params), exact)
    assert rejects, f"chi2 {stat:.1f} <= critical {crit:.1f}: the test cannot see a biased sampler"


def test_verify_greedy_follows_the_targets_tokens_down_the_tree():
    from peagle.engine.draft_tree import DraftTree
    from peagle.engine.verify import verify_greedy

    chain = DraftTree.chain([1, 2, 3])
    assert verify_greedy(chain, [1, 2, 3, 4]) == ([0, 1, 2], [1, 2, 3, 4])
    assert verify_greedy(chain, [1, 9, 3, 4]) == ([0], [1, 9])
    assert verify_greedy(chain, [7, 2, 3, 4]) == ([], [7])
    # x_n -> {5, 6}; 5 -> 7; 6 -> {8, 9}: the target's tokens 6, 9 go down the second branch
    tree = DraftTree((5, 6, 7, 8, 9), (-1, -1, 0, 1, 1))
    assert verify_greedy(tree, [6, 0, 9, 0, 0, 4]) == ([1, 4], [6, 9, 4])
    assert verify_greedy(tree, [5, 7, 0, 1, 0, 0]) == ([0, 2], [5, 7, 1])
    assert verify_greedy(tree, [3, 0, 0, 0, 0, 0]) == ([], [3])


def test_top_p_top_k_processing():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    assert list(itertools.islice(p.tolist(), 1)) == pytest.approx([0.5 / 0.95])
