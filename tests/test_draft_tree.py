"""Draft trees: built best first from a head's candidates, verified in one forward whose rows each read their own
branch (the bits of that branch as a chain), the accepted branch moved into place, greedy output unchanged for
every tree shape, and sampling keeping the target's distribution (docs/design.md, "Draft trees")."""
from __future__ import annotations

import math

import pytest
import torch

from peagle.config import EAGLE2_BEAMS, MAX_TREE_NODES, SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.draft_tree import Candidates, DraftTree, ExpandedTree, TreeShaper
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
    with pytest.raises(ValueError, match="nodes expanded per depth"):
        SpeculativeConfig(model="x", method="eagle3", draft_tree_beams=MAX_TREE_NODES + 1)
    dynamic = SpeculativeConfig(model="x", method="eagle3", draft_tree_beams=EAGLE2_BEAMS)
    assert dynamic.to_dict()["draft_tree_beams"] == EAGLE2_BEAMS
    assert "draft_tree_beams" not in dynamic.for_vllm().to_dict()
    assert "draft_tree_beams" not in SpeculativeConfig(model="x", method="eagle3").to_dict()
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
        shaper.observe(shaper.shape(CANDIDATES, 1.0, 1, cost.seconds), [])
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
    real_draft, real_logits, real_forward, context = engine.proposer.draft, engine.drafter.logits, \
        engine.drafter.forward, {}

    def draft(reqs, slots, k, *rest):
        context["reqs"], context["depth"] = reqs, 0
        return real_draft(reqs, slots, k, *rest)

    def forward(tokens, features, layout, cache):  # each row's request (a dynamic tree's beams: several rows each)
        context["slots"] = layout.slots.tolist()
        return real_forward(tokens, features, layout, cache)

    def logits(hidden):  # P-EAGLE: every depth in one call; EAGLE-3: one call per depth
        out, depth = real_logits(hidden), context["depth"]
        context["depth"] += out.shape[1]
        by_slot = {req.slot: req for req in context["reqs"]}
        for b, slot in enumerate(context["slots"]):
            req = by_slot[slot]
            ref = reference[tuple(req.prompt_ids)]
            for i in range(out.shape[1]):
                j = len(req.output_ids) + depth + i
                right = ref[j] if j < len(ref) else 0
                wrong = (right + 1) % out.shape[-1]
                out[b, i] = 0.0
                out[b, i, right], out[b, i, wrong] = (6.0, 7.0) if j % 3 == 2 else (7.0, 6.0)
        return out

    engine.proposer.draft, engine.drafter.logits, engine.drafter.forward = draft, logits, forward


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


def eagle3_trees(target: TargetModel, k: int, max_num_seqs: int, nodes, beams: int = EAGLE2_BEAMS,
                 max_model_len: int = 128) -> LLMEngine:
    """An EAGLE-3 head drafting dynamic trees: `nodes` "auto" under the adaptive policy, with rows nearly free (as
    on a CPU with AMX) so that it drafts and the shaper grows trees; a node count under the fixed policy."""
    head = random_head(target.config, target.embed_tokens.weight, "eagle3", seed=2)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=k, draft_tree_nodes=nodes, draft_tree_beams=beams)
    engine = LLMEngine(target, None, head, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       speculation_policy="adaptive" if nodes == "auto" else "fixed")
    if nodes == "auto":
        cost = engine.policy.cost
        cost.target = [1.0 + 0.01 * n for n in range(len(cost.target))]
        cost.draft = [[0.1 * bool(k) for k in row] for row in cost.draft]
        engine.policy.observe_step = lambda *timing: None
    return engine


@needs_native_kernels
@pytest.mark.parametrize("nodes", ["auto", 12])
@pytest.mark.parametrize("max_num_seqs", [1, 3])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_greedy_output_with_dynamic_trees_equals_plain_greedy(tiny_target, k, max_num_seqs, nodes, one_thread):
    """EAGLE-2's dynamic tree on an EAGLE-3 head: lossless, and its branches run past a rejected first child
    (accepted beyond what the chain and a side leaf could)."""
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(tiny_target, None, max_num_seqs=1, max_model_len=128)
    reference = {tuple(p): plain.generate([p], params)[0].token_ids for p in prompts}
    engine = eagle3_trees(tiny_target, k, max_num_seqs, nodes)
    assert engine.proposer.beams == EAGLE2_BEAMS
    oracle_heads(engine, reference)
    outcomes, record = [], engine._record
    engine._record = lambda outcome: (outcomes.append(outcome), record(outcome))
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    assert engine.stats.mean_draft_tokens > k
    if k > 2:
        assert any(o.accepted >= o.chain_accepted + 2 for o in outcomes)


@needs_native_kernels
def test_dynamic_trees_leave_the_drafters_chain_as_it_was(tiny_target, one_thread):
    """The beams' scratch rows are overwritten by the next catch-up's real rows or never read: every step's chain
    is the one a head drafting side leaves (no scratch rows past its chain) drafts at the same point."""
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    chains = []
    for beams in (EAGLE2_BEAMS, 0):
        engine, seen = eagle3_trees(tiny_target, 4, 3, 12, beams), {}
        real_draft = engine.proposer.draft

        def draft(reqs, slots, k, *rest, real_draft=real_draft, seen=seen):
            made, cands = real_draft(reqs, slots, k, *rest)
            for r, tokens in zip(reqs, made.tolist()):
                seen[(tuple(r.prompt_ids), len(r.output_ids))] = tokens
            return made, cands

        engine.proposer.draft = draft
        outs = engine.generate(prompts, params)
        chains.append(seen)
    common = chains[0].keys() & chains[1].keys()
    assert len(common) > 10 and all(chains[0][c] == chains[1][c] for c in common)


@needs_native_kernels
def test_dynamic_trees_draft_up_to_the_length_limit(tiny_target, one_thread):
    """The beams' scratch rows past the last real row (K - 1 depths of 32 here, far more than max_model_len) fit in
    the caches: the engine reserves them."""
    prompts = [[5, 9, 17, 33, 2 + i] for i in range(3)]
    params = SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(tiny_target, None, max_num_seqs=1, max_model_len=24)
    engine = eagle3_trees(tiny_target, 7, 3, 16, beams=MAX_TREE_NODES, max_model_len=24)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [plain.generate([p], params)[0].token_ids for p in prompts]
    assert all(len(p) + len(o.token_ids) == 24 for p, o in zip(prompts, outs))
    assert engine.stats.num_drafts > 0


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


# -- EAGLE-2's dynamic tree on an EAGLE-3 head ---------------------------------------------------------------------
def test_an_expanded_tree_is_shaped_as_candidates_are():
    """Best first by branch probability (a child never above its parent), a chain view, and a cut by depth."""
    lp = math.log
    tree = ExpandedTree(tokens=[10, 11, 20, 21, 22, 30], parents=[-1, -1, 0, 0, 1, 2],
                        logprobs=[lp(.6), lp(.3), lp(.6 * .5), lp(.6 * .4), lp(.3 * .8), lp(.6 * .5 * .9)],
                        chain_nodes=[0, 2, 5])
    best = tree.best_first(4)
    assert [round(p, 3) for p in best.probs] == [.6, .3, .3, .27]
    assert [tuple(best.tokens[j] for j in best.branch(i)) for i in range(4)] == [(10,), (11,), (10, 20), (10, 20, 30)]
    assert tree.chain.tokens == (10, 20, 30) and tree.chain.is_chain
    assert [round(p, 3) for p in tree.chain.probs] == [.6, .3, .27]
    cut = tree.cut(2)
    assert cut.tokens == [10, 11, 20, 21, 22] and cut.chain.tokens == (10, 20)
    cost = type("Cost", (), {"max_rows": 64})()
    assert TreeShaper("auto", None, cost).shape(tree, 1.0, 1, lambda rows: 1.0 + 0.001 * rows).depth == 3


def packed_eagle3_head(native: bool):
    from tests.test_drafter import make_head, target_config

    head = make_head(target_config.__wrapped__(), parallel=False, seed=21)
    return head.to(torch.bfloat16).pack_() if native else head


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native_kernels), False],
                         ids=["native-layers", "modules"])
def test_each_beam_drafts_what_its_branch_drafts_as_a_chain(native, one_thread):
    """A beam row reads the real rows and its own ancestors only: its children are the chain's along its branch."""
    from tests.test_drafter import context

    head = packed_eagle3_head(native)
    toks, feats = context(12, seed=22)
    feats = feats.to(head.fc.weight.dtype)
    args = toks[None], feats[None], torch.tensor([12]), torch.tensor([0]), torch.tensor([0])
    chain, trees = head.draft_tree(*args, head.new_cache(1, 64), 4, [3], 4)
    tokens, parents, logprobs, chain_nodes = trees[0]
    assert chain[0].tolist() == [tokens[i] for i in chain_nodes]
    assert chain.tolist() == head.draft_chain(*args, head.new_cache(1, 64), 4).tolist()
    assert all(p < i for i, p in enumerate(parents)) and len(tokens) == 4 + 3 * 3 * 4
    expanded = sorted({p for p in parents if p >= 0})
    assert len(expanded) == 3 * 3 and set(chain_nodes[:3]) <= set(expanded)
    for node in expanded:
        if node in chain_nodes:
            continue
        branch = []
        i = node
        while i >= 0:
            branch.insert(0, tokens[i])
            i = parents[i]
        seen = []

        def forced(depth, logits):  # the chain along the branch, then the logits of the node's children
            seen.append(torch.log_softmax(logits.float(), -1).topk(4, -1))
            return torch.tensor([branch[depth] if depth < len(branch) else 0])

        head.draft_chain(*args, head.new_cache(1, 64), len(branch) + 1, pick=forced)
        want = seen[len(branch)]
        children = [j for j, p in enumerate(parents) if p == node]
        assert [tokens[j] for j in children] == head.to_target_ids(want.indices[0]).tolist()
        got = torch.tensor([logprobs[j] - logprobs[node] for j in children], dtype=torch.float64)
        if native:  # the same bits: every row is computed on its own
            assert torch.equal(got.float(), want.values[0])
        else:
            torch.testing.assert_close(got.float(), want.values[0], atol=1e-4, rtol=1e-4)


@needs_native_kernels
def test_a_requests_dynamic_tree_does_not_depend_on_its_batch(one_thread):
    from tests.test_drafter import context

    head = packed_eagle3_head(True)
    alone, lengths = [], [12, 7, 9]
    rows = [context(n, seed=30 + b) for b, n in enumerate(lengths)]
    for b, (toks, feats) in enumerate(rows):
        cache = head.new_cache(3, 64)
        alone.append(head.draft_tree(toks[None], feats[None].to(torch.bfloat16), torch.tensor([len(toks)]),
                                     torch.tensor([0]), torch.tensor([b]), cache, 3, [4], 8)[1][0])
    R = max(lengths)
    tokens = torch.zeros(3, R, dtype=torch.long)
    feats = torch.zeros(3, R, rows[0][1].shape[-1], dtype=torch.bfloat16)
    for b, (t, f) in enumerate(rows):
        tokens[b, :len(t)], feats[b, :len(t)] = t, f
    _, together = head.draft_tree(tokens, feats, torch.tensor(lengths), torch.tensor([0, 0, 0]),
                                  torch.tensor([0, 1, 2]), head.new_cache(3, 64), 3, [4, 4, 4], 8)
    assert together == alone


def test_sampling_over_a_dynamic_tree_keeps_the_target_distribution(small_vocab_target):
    """EAGLE-3 dynamic trees under the multi-candidate rule: the draws keep the target's distribution."""
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(small_vocab_target, params)
    head = random_head(small_vocab_target.config, small_vocab_target.embed_tokens.weight, "eagle3", seed=1,
                       dtype=torch.float32)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=3, draft_tree_nodes=24,
                             draft_tree_beams=EAGLE2_BEAMS)
    engine = LLMEngine(small_vocab_target, None, head, spec, max_num_seqs=256, max_model_len=32,
                       speculation_policy="fixed", max_num_batched_tokens=2048)
    assert engine.proposer.beams == EAGLE2_BEAMS
    counts = sample_joint(engine, params)
    rate = engine.stats.acceptance_per_position
    assert engine.stats.mean_draft_tokens > 20 and rate[0] > 0.2 and rate[1] > 0.05, rate
    rejects, stat, crit = chi_square_rejects(counts, exact)
    assert not rejects, f"chi2 {stat:.1f} > critical {crit:.1f}: dynamic trees changed the distribution"
