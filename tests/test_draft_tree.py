"""Draft trees: built best first from a head's candidates, verified in one forward whose rows each read their own
branch (the bits of that branch as a chain), the accepted branch moved into place, greedy output unchanged for
every tree shape, and sampling keeping the target's distribution (docs/design.md, "Draft trees")."""
from __future__ import annotations

import math

import pytest
import torch

from peagle.config import MAX_TREE_NODES, SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.draft_tree import Candidates, DraftTree, TreeShaper
from peagle.model.checkpoint import random_head
from peagle.model.layers import BatchLayout, KVCache
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model, needs_native_kernels
from tests.test_sampling import chi_square_rejects, exact_joint, sample_joint, small_vocab_target  # noqa: F401

CANDIDATES = Candidates(tokens=[[10, 11, 12], [20, 21, 22], [30, 31, 32]],
                        logprobs=[[math.log(p) for p in ps] for ps in ([.6, .3, .1], [.5, .4, .1], [.9, .05, .05])],
                        free=True)


def test_best_first_takes_the_most_probable_branches_in_order():
    tree = CANDIDATES.best_first(6)
    assert list(tree.probs) == sorted(tree.probs, reverse=True)
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first: always a tree
    # .6 (10), .3 (11), .6*.5 = .3 (10 20), .27 (10 20 30), .24 (10 21), .216 (10 21 30); not .15 (11 20)
    branches = {tuple(tree.tokens[j] for j in tree.branch(i)) for i in range(len(tree))}
    assert branches == {(10,), (11,), (10, 20), (10, 20, 30), (10, 21), (10, 21, 30)}
    assert [round(p, 3) for p in tree.probs] == [.6, .3, .3, .27, .24, .216]
    assert tree.depth == 3 and not tree.is_chain
    # an EAGLE-3 chain knows what follows its own top tokens only: alternatives are leaves beside the chain
    chain_only = Candidates(CANDIDATES.tokens, CANDIDATES.logprobs, free=False).best_first(6)
    for i, parent in enumerate(chain_only.parents):
        assert parent < 0 or chain_only.branch(parent) == list(range(len(chain_only.branch(parent))))


def test_a_static_tree_takes_each_nodes_ranked_candidate():
    paths = SpeculativeConfig(model="x", method="peagle",
                              speculative_token_tree="[(1, 0), (0,), (1,), (0, 0), (0, 0, 2)]").token_tree
    tree = CANDIDATES.ranked(paths)
    assert [tuple(tree.tokens[j] for j in tree.branch(i)) for i in range(len(tree))] == [
        (10,), (11,), (10, 20), (11, 20), (10, 20, 32)]
    assert DraftTree.chain([5, 6, 7]).is_chain and DraftTree.chain([5, 6, 7]).depth == 3


@pytest.mark.parametrize("bad, says", [("[(0, 0)]", "no parent"), ("[(8,)]", "candidate ranks"),
                                       ("(0,", "list of tuples"), ("[]", "non-empty")])
def test_a_bad_token_tree_names_the_fault(bad, says):
    with pytest.raises(ValueError, match=says):
        SpeculativeConfig(model="x", method="peagle", speculative_token_tree=bad)


def test_tree_config_keys():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(model="x", method="peagle", num_speculative_tokens=1, speculative_token_tree="[(0,), (0, 0)]")
    with pytest.raises(ValueError, match="one chain"):
        SpeculativeConfig(model="x", method="eagle3", speculative_token_tree="[(0,), (1,), (1, 0)]")
    with pytest.raises(ValueError, match="no head"):
        SpeculativeConfig(method="ngram", speculative_token_tree="[(0,)]")
    with pytest.raises(ValueError, match="node budget"):
        SpeculativeConfig(model="x", method="peagle", draft_tree_nodes=MAX_TREE_NODES + 1)
    spec = SpeculativeConfig(model="x", method="peagle", draft_tree_nodes=8)
    assert spec.to_dict()["draft_tree_nodes"] == 8 and "draft_tree_nodes" not in spec.for_vllm().to_dict()
    assert "draft_tree_nodes" not in SpeculativeConfig(model="x", method="peagle").to_dict()  # "auto": unsaid
    assert SpeculativeConfig(model="x", method="peagle", speculative_token_tree="[(0,), (0, 0)]").num_speculative_tokens == 2


def test_the_shaper_keeps_chains_where_rows_are_dear_and_grows_trees_where_they_are_cheap():
    class Cost:
        max_rows = 64

        def __init__(self, per_row):
            self.per_row = per_row

        def seconds(self, rows):
            return 1.0 + self.per_row * rows

    for per_row, want_tree in ((0.3, False), (0.005, True)):
        cost = Cost(per_row)
        tree = TreeShaper("auto", None, cost).shape(CANDIDATES, 1.0, 1, cost.seconds)
        assert tree.is_chain != want_tree, (per_row, tree)
    # what it learns: a head whose depth-1 promises are never borne out stops getting depth-1 siblings
    shaper, cost = TreeShaper("auto", None, Cost(0.005)), Cost(0.005)
    for _ in range(200):
        shaper.observe(shaper.shape(CANDIDATES, 1.0, 1, cost.seconds), 0)
    assert shaper.calibration(1) < 0.1
    assert len(shaper.shape(CANDIDATES, 1.0, 1, cost.seconds)) < len(TreeShaper("auto", None, cost).shape(
        CANDIDATES, 1.0, 1, cost.seconds))


def test_moving_a_branch_copies_every_layers_keys_and_values():
    cache = KVCache(2, 1, 64, 2, 8, torch.bfloat16, num_blocks=5)
    cache.ensure(torch.tensor([0]), torch.arange(40)[None])
    for c in (*cache.k, *cache.v):
        c.copy_(torch.randn(c.shape))
    before = [layer.gather(torch.tensor([0]), 40) for layer in cache.layers]
    cache.move(0, [33, 36], [17, 18])  # across a block boundary
    for layer, (k0, v0) in zip(cache.layers, before):
        k1, v1 = layer.gather(torch.tensor([0]), 40)
        for old, new in ((k0, k1), (v0, v1)):
            assert torch.equal(new[:, :, 17], old[:, :, 33]) and torch.equal(new[:, :, 18], old[:, :, 36])
            assert torch.equal(new[:, :, :17], old[:, :, :17]) and torch.equal(new[:, :, 19:], old[:, :, 19:])


@needs_native_kernels
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("native", [True, False], ids=["native-layers", "modules"])
def test_a_tree_forward_gives_each_branch_its_chain_bits(tmp_path, family, native, one_thread):
    """Gemma 3's sliding windows (8 keys here, so they bite) read the tree's branch inside each window."""
    extra = {"sliding_window": 8} if family == "gemma3_text" else {}
    target = TargetModel.from_pretrained(make_tiny_model(tmp_path, family, **extra))
    if native:
        target.pack_()
    cache = target.new_cache(2, 64)
    prompt = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    for slot in (0, 1):
        target(prompt, BatchLayout.build(torch.tensor([slot]), torch.arange(20)[None]), cache)
    tree = DraftTree((11, 12, 13, 14, 15), (-1, -1, 0, 1, 2))  # x_n -> {11, 12}; 11 -> 13 -> 15; 12 -> 14
    rope, keys = tree.verify_keys(20)
    stride = max(map(len, keys))
    layout = BatchLayout.tree(torch.tensor([0]), (20 + torch.arange(6))[None], torch.tensor([rope]), torch.tensor(
        [k + [0] * (stride - len(k)) for k in keys], dtype=torch.int32))
    out = target(torch.tensor([[7, *tree.tokens]]), layout, cache, num_logits=None)
    for leaf in (3, 4):
        branch = tree.branch(leaf)
        chain = torch.tensor([[7] + [tree.tokens[i] for i in branch]])
        alone = target(chain, BatchLayout.build(torch.tensor([1]), (20 + torch.arange(chain.shape[1]))[None]), cache,
                       num_logits=None)
        assert torch.equal(alone.logits[0], out.logits[0, [0] + [i + 1 for i in branch]]), (family, leaf)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> TargetModel:
    target = TargetModel.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("tree-target"), "llama", seed=5))
    return target.pack_()


def oracle_heads(engine: LLMEngine, reference: dict[tuple, list[int]]) -> None:
    """Drafter logits whose top token is right two times in three and whose second is right the third time, so
    the first children are often rejected where a sibling is accepted: branches other than the first are taken."""
    real_draft, real_logits, context = engine.proposer.draft, engine.drafter.logits, {}

    def draft(reqs, slots, k, *rest):
        context["reqs"], context["depth"] = reqs, 0
        return real_draft(reqs, slots, k, *rest)

    def logits(hidden):  # P-EAGLE: every depth in one call; EAGLE-3: one call per depth
        out, depth = real_logits(hidden), context["depth"]
        context["depth"] += out.shape[1]
        for b, req in enumerate(context["reqs"]):
            ref = reference[tuple(req.prompt_ids)]
            for i in range(out.shape[1]):
                j = len(req.output_ids) + depth + i
                right = ref[j] if j < len(ref) else 0
                wrong = (right + 1) % out.shape[-1]
                out[b, i] = 0.0
                out[b, i, right], out[b, i, wrong] = (6.0, 7.0) if j % 3 == 2 else (7.0, 6.0)
        return out

    engine.proposer.draft, engine.drafter.logits = draft, logits


@needs_native_kernels
@pytest.mark.parametrize("tree", [{"draft_tree_nodes": 8}, {"speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0), "
                                                                                     "(0, 1), (0, 0, 0)]"},
                                  {"draft_tree_nodes": "auto"}], ids=["best-8", "static", "auto"])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_greedy_output_with_trees_equals_plain_greedy(tiny_target, tree, method, one_thread):
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(tiny_target, None, max_num_seqs=1, max_model_len=128)
    reference = {tuple(p): plain.generate([p], params)[0].token_ids for p in prompts}
    if method == "eagle3" and "speculative_token_tree" in tree:
        tree = {"speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]"}
    head = random_head(tiny_target.config, tiny_target.embed_tokens.weight, method, mask_token_id=3, seed=2)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=3, parallel_drafting=method == "peagle", **tree)
    auto = tree.get("draft_tree_nodes") == "auto"  # the adaptive policy's trees; the others under the fixed policy
    engine = LLMEngine(tiny_target, None, head, spec, max_num_seqs=3, max_model_len=128,
                       speculation_policy="adaptive" if auto else "fixed")
    oracle_heads(engine, reference)
    if auto:  # rows nearly free, as on a CPU with AMX: the policy drafts and the shaper grows trees
        cost = engine.policy.cost
        cost.target = [1.0 + 0.01 * n for n in range(len(cost.target))]
        cost.draft = [[0.1 * bool(k) for k in row] for row in cost.draft]
        cost.observe = lambda *timing: None
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    stats = engine.stats
    assert stats.mean_draft_tokens > 3  # trees, not chains, were verified
    assert stats.mean_acceptance_length > 1.8, stats.as_dict()  # the second candidates were taken


def tree_sampler(target: TargetModel, tree: str) -> LLMEngine:
    head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=1,
                       dtype=torch.float32)
    spec = SpeculativeConfig(model="random", parallel_drafting=True, speculative_token_tree=tree)
    return LLMEngine(target, None, head, spec, max_num_seqs=256, max_model_len=32, speculation_policy="fixed",
                     max_num_batched_tokens=2048)


def sibling_blind_verify(tree, probs, generator):
    """A wrong rule: a rejected sibling stays in the distribution the next sibling and the fallback draw from."""
    path = []
    while True:
        row = path[-1] + 1 if path else 0
        nxt = next((c for c in tree.children[path[-1] if path else -1]
                    if float(torch.rand(1, generator=generator)) < float(probs[row, tree.tokens[c]])), None)
        if nxt is None:
            token = int(torch.multinomial(probs[row], 1, generator=generator))
            return path, [tree.tokens[i] for i in path] + [token]
        path.append(nxt)


@pytest.mark.parametrize("rule", ["multi-candidate", "sibling-blind"])
def test_sampling_over_a_tree_keeps_the_target_distribution(small_vocab_target, rule, monkeypatch):
    from peagle.engine import engine as engine_module

    if rule == "sibling-blind":
        monkeypatch.setattr(engine_module, "verify_sampled", sibling_blind_verify)
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(small_vocab_target, params)
    engine = tree_sampler(small_vocab_target, "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]")
    counts = sample_joint(engine, params)
    rate = engine.stats.acceptance_per_position
    assert engine.stats.mean_draft_tokens > 6 and rate[0] > 0.2 and rate[1] > 0.05, rate
    rejects, stat, crit = chi_square_rejects(counts, exact)
    if rule == "multi-candidate":
        assert not rejects, f"chi2 {stat:.1f} > critical {crit:.1f}: trees changed the distribution"
    else:
        assert rejects, f"chi2 {stat:.1f} <= critical {crit:.1f}: the test cannot see a sibling-blind sampler"
