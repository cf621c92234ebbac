"""Suffix drafts as draft trees: the suffix tree's other continuations become side leaves whose probabilities are
measured live per rank and count, grafted onto the draft's chain (or, in the hybrid, onto the head's tree) only as
far as the cost model says the rows pay; greedy output stays plain greedy's (docs/engine.md, "Draft trees")."""
from __future__ import annotations

import math

import pytest

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.acceptance import Draft, SideLeaf
from peagle.engine.draft_tree import Candidates, DraftTree, TreeShaper
from peagle.engine.proposers.side_leaves import SideLeafAcceptance
from peagle.engine.proposers.suffix_tree import SuffixCache
from peagle.model.checkpoint import random_head
from tests.conftest import needs_native_kernels
from tests.test_draft_tree import tiny_target  # noqa: F401


class LinearCost:
    max_rows = 64

    def __init__(self, per_row: float):
        self.per_row = per_row

    def seconds(self, rows: int) -> float:
        return 1.0 + self.per_row * rows


def test_a_suffix_draft_carries_the_other_continuations_it_saw():
    cache = SuffixCache(max_tree_depth=24, max_cached_requests=10)
    cache.start_request("r", sum(([10 + i, 1, 2, 3, 4 + i % 2] for i in range(6)), []) + [20, 1, 2, 3])
    draft = cache.speculate("r", 24, 1.0, 0.1, alternatives=7)  # after "1 2 3": 4 three times, 5 three times
    assert draft.tokens[0] == 4 and draft.probs[0] == 0.5 and draft.others[0] == ((5, 3, 0.5),)
    assert len(draft.others) == len(draft.tokens)
    plain = cache.speculate("r", 24, 1.0, 0.1)
    assert plain.others == () and (plain.tokens, plain.probs) == (draft.tokens, draft.probs)  # the same draft


def test_branches_come_most_probable_first_and_parents_first():
    draft = Draft("suffix", [4, 6, 7], [0.8, 0.6, 0.3], (SideLeaf(0, 5, 1, 3, 0.25), SideLeaf(1, 9, 1, 1, 0.5),
                                                          SideLeaf(2, 8, 1, 1, 0.9)))
    assert draft.branches(2) == [((4,), 0.8), ((4, 6), 0.6), ((4, 9), 0.4), ((5,), 0.25)]
    full = draft.branches(3)
    assert [round(p, 3) for _, p in full] == sorted((round(p, 3) for _, p in full), reverse=True)
    assert ((4, 6, 8), pytest.approx(0.54)) in [(path, pytest.approx(p)) for path, p in full]


def test_side_leaves_are_measured_from_what_the_target_emitted_whatever_was_verified():
    acceptance = SideLeafAcceptance()
    assert acceptance.estimate(1, 3, 0.5) == 0.5  # no evidence: the tree's share
    draft = Draft("suffix", [4, 6, 7], [0.9, 0.8, 0.7], (SideLeaf(1, 9, 1, 3, 0.5), SideLeaf(2, 8, 1, 1, 0.5)))
    for _ in range(30):  # a chain verified: 4 accepted, then the target said 9 (the leaf), never reaching 8's place
        acceptance.observe(draft, [4, 9])
    assert acceptance.estimate(1, 3, 0.5) > 0.9
    assert acceptance.estimate(1, 1, 0.5) == 0.5  # position 2 was never reached
    for _ in range(60):  # the target keeps the draft's own tokens: the leaf is tried and never right
        acceptance.observe(draft, [4, 6, 7, 1])
    assert acceptance.estimate(1, 3, 0.5) < 0.4 and acceptance.estimate(1, 1, 0.5) < 0.05


def test_grafting_keeps_the_chain_where_rows_are_dear_and_adds_leaves_where_they_are_cheap():
    chain = DraftTree.chain([4, 6, 7])
    draft = Draft("suffix", [4, 6, 7], [0.9, 0.5, 0.3], (SideLeaf(1, 9, 1, 3, 0.4), SideLeaf(2, 8, 2, 1, 0.1)))
    for per_row, want in ((0.3, 0), (0.05, 1), (0.001, 2)):
        cost = LinearCost(per_row)
        shaper = TreeShaper("auto", None, cost)
        tree = shaper.grow(chain, 1.0 + 1.7, draft.branches(3), shaper.price(1, cost.seconds))
        assert len(tree) - len(chain) == want, (per_row, tree)
        assert tree.tokens[:3] == chain.tokens and tree.parents[:3] == chain.parents  # the chain as it was
    assert tree.parents[3:] == (0, 1) and tree.tokens[3:] == (9, 8)
    # a tree with no room left stays as it is
    assert TreeShaper.grow(chain, 2.7, draft.branches(3), [1.0, 1.0, 1.0, 1.0]) == chain


def test_a_head_tree_grafts_the_suffix_draft_it_beat_and_calibrates_on_its_own_nodes():
    head = Candidates([[10, 11], [20, 21]], [[math.log(0.5), math.log(0.2)], [math.log(0.5), math.log(0.1)]],
                      free=True)
    suffix = Draft("suffix", [11, 30, 31], [0.9, 0.9, 0.9])  # the head's second candidate, then a long run
    cost = LinearCost(0.01)
    plain = TreeShaper("auto", None, cost).shape(head, 1.0, 1, cost.seconds)
    head.beside = suffix.branches(3)
    shaper = TreeShaper("auto", None, cost)
    tree = shaper.shape(head, 1.0, 1, cost.seconds)
    assert tree.tokens[: len(plain)] == plain.tokens  # the head's tree first, as it would be alone
    branches = {tuple(tree.tokens[j] for j in tree.branch(i)): tree.probs[i] for i in range(len(tree))}
    assert branches[(11,)] > 0 and branches[(11, 30)] == 0 and branches[(11, 30, 31)] == 0
    # the path ran through the head's node 11, then grafted ones: the head's calibration hears of depth 1 only
    path = [tree.tokens.index(11), *(i for i in range(len(tree)) if tree.probs[i] == 0)]
    shaper.observe(tree, path)
    assert shaper.reached[0] == 1 and shaper.reached[1] == 0
    assert tree.head_depth == plain.depth < tree.depth and tree.first_children(path) == 0  # the policy's view


def scripted_suffix_drafts(engine: LLMEngine, reference: dict[tuple, list[int]], vocab: int) -> None:
    """Suffix drafts of one token whose own token is wrong every third position where its side leaf is right."""
    def score(reqs):
        out = []
        for req in reqs:
            j, ref = len(req.output_ids), reference[tuple(req.prompt_ids)]
            right = ref[j] if j < len(ref) else 0
            wrong = (right + 1) % vocab
            own, leaf = (wrong, right) if j % 3 == 0 else (right, wrong)
            out.append(Draft("suffix", [own], [0.9], (SideLeaf(0, leaf, 1, 2, 0.4),)))
        return out

    engine.proposer.score = score


def cheap_rows(engine: LLMEngine) -> None:
    """Rows nearly free, as on a CPU with AMX: the shaper grafts what pays at all."""
    cost = engine.policy.cost
    cost.target = [1.0 + 0.01 * n for n in range(len(cost.target))]
    cost.draft = [[0.1 * bool(k) for k in row] for row in cost.draft]
    cost.observe = lambda *timing: None


@needs_native_kernels
@pytest.mark.parametrize("rows", ["cheap", "dear"])
def test_side_leaves_are_verified_where_they_pay_and_the_output_unchanged(tiny_target, rows, one_thread):
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(tiny_target, None, max_num_seqs=1, max_model_len=128)
    reference = {tuple(p): plain.generate([p], params)[0].token_ids for p in prompts}
    engine = LLMEngine(tiny_target, None, None, SpeculativeConfig(method="suffix"), max_num_seqs=3, max_model_len=128)
    assert engine.trees.sizes
    if rows == "cheap":
        cheap_rows(engine)
    else:  # a row costs half a plain step: a draft of 0.9 pays, a leaf of 0.4 beside it does not
        cost = engine.policy.cost
        cost.target = [1.0 + 0.5 * n for n in range(len(cost.target))]
        cost.observe = lambda *timing: None
    scripted_suffix_drafts(engine, reference, tiny_target.config.vocab_size)
    verified, record = [], engine._record
    engine._record = lambda outcome: (verified.append(outcome), record(outcome))
    assert [o.token_ids for o in engine.generate(prompts, params)] == [reference[tuple(p)] for p in prompts]
    trees = [o for o in verified if not o.tree.is_chain]
    if rows == "cheap":
        assert any(o.accepted and o.chain_accepted == 0 for o in trees), "no side leaf was verified and taken"
    else:
        assert not trees and any(o.drafted for o in verified)


@needs_native_kernels
def test_the_hybrid_grafts_its_suffix_draft_onto_the_heads_tree_losslessly(tiny_target, one_thread):
    prompts = [[5, 9, 17, 33, 40, 41] * 3 + [2 + i] for i in range(3)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(tiny_target, None, max_num_seqs=1, max_model_len=128)
    reference = [plain.generate([p], params)[0].token_ids for p in prompts]
    head = random_head(tiny_target.config, tiny_target.embed_tokens.weight, "peagle", mask_token_id=3, seed=2)
    spec = SpeculativeConfig(model="random", method="hybrid", num_speculative_tokens=3, parallel_drafting=True)
    engine = LLMEngine(tiny_target, None, head, spec, max_num_seqs=3, max_model_len=128)
    cheap_rows(engine)
    value = engine.policy.value  # the head always beats the suffix draft, so the draft goes beside it
    engine.policy.value = lambda c, batch=1: 2.0 if c.draft is None else min(1.5, value(c, batch))
    grafted, observe = [], engine.trees.observe
    engine.trees.observe = lambda tree, path: (grafted.append(any(not tree.probs[i] for i in path)),
                                               observe(tree, path))
    assert [o.token_ids for o in engine.generate(prompts, params)] == reference
    assert any(grafted), "no grafted suffix node was accepted"
