"""The speculation policy: adaptive K on synthetic acceptance and costs, lossless decoding with it on (greedy token
for token, sampling in distribution), and a drafter that resumes after plain (K = 0) steps exactly where it would
have been had it drafted all along."""
from __future__ import annotations

import random

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine import engine as engine_module
from peagle.engine.forward_cost import ForwardCost
from peagle.engine.policy import AdaptiveK, Candidate, FixedK, make_policy
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model
from tests.test_sampling import VOCAB, chi_square_rejects, exact_joint, sample_joint, small_vocab_target  # noqa: F401

MAX_K = 7


# -- the policy on synthetic inputs -------------------------------------------------------------------------------

def no_drafter_cost(requests: int, k: int) -> float:
    return 0.0


def policy_with_cost(target, draft=no_drafter_cost, max_batch: int = 8, max_k: int = MAX_K) -> AdaptiveK:
    """target(rows) and draft(requests, k): step costs in seconds."""
    policy = AdaptiveK(ForwardCost(max_batch, max_k))
    policy.cost.calibrate_decode(target, draft)
    return policy


def feed(policy: AdaptiveK, request_id: str, acceptance: float, steps: int, rng: random.Random) -> list[int]:
    """Run `steps` steps of one request whose drafts are each accepted with probability `acceptance`; the K the
    policy chose at each step."""
    chosen = []
    for _ in range(steps):
        [k] = policy.choose([Candidate(request_id, 1000)])
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policy.observe(request_id, k, accepted)
        chosen.append(k)
    return chosen


def test_zero_acceptance_chooses_plain_steps():
    policy = policy_with_cost(lambda rows: 1.0, lambda m, k: 0.1 * k)
    chosen = feed(policy, "a", 0.0, 60, random.Random(0))
    # Plain steps, but for single-draft probes: every few steps while one draft still looks nearly as good as a
    # plain step (here a probe costs a tenth of a step, and the estimate starts optimistic), then ever rarer.
    probes = [i for i, k in enumerate(chosen) if i >= 6 and k]
    assert set(chosen[6:]) == {0, 1} and len(probes) <= 10, chosen
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] > gaps[0], chosen
    # A new request starts from the engine-wide estimate, which has learnt that drafts fail.
    policy.plain_steps_in_a_row = 0
    assert policy.choose([Candidate("new", 1000)]) == [0]


def test_a_drafts_value_is_measured_in_its_batch():
    """value(): the step's tokens per second when this request alone drafts, over a plain step's. Where reading
    the weights is most of a step, a draft that pays alone does not in a batch, which already shares that read."""
    from peagle.engine.proposers.base import Draft

    policy = policy_with_cost(lambda rows: 1.0 + 0.2 * rows)
    draft = Candidate("a", 1000, Draft("suffix", [5], [0.2]))
    alone = (1 + 0.2) / (1.0 + 0.2 * 2) * (1.0 + 0.2 * 1)  # tokens / cost of the window, times a plain step's
    assert policy.value(draft) == pytest.approx(alone) and alone > 1
    assert policy.value(draft, batch=4) == 1.0  # (4.2 / 2.0) * (1.8 / 4) < 1: no window beats plain


def test_a_head_that_pays_a_little_is_not_written_off_by_early_rejections():
    """Costs of the embedded model on a CPU (a 2-row verify 1.12 plain steps, a draft 0.19) and drafts accepted
    about half the time: K = 1 pays about 1.1x, so most steps should draft. An estimate that a few early rejections
    pushed below the break-even point is corrected only by drafting steps: probes must come often while one draft
    is nearly as good as a plain step, or the policy stays plain (it drafted in 42% of steps with probes that
    doubled their wait after each miss)."""
    shares = []
    for seed in range(4):
        policy = policy_with_cost(lambda rows: 1.0 + 0.12 * (rows - 1), lambda m, k: 0.19 + 0.07 * (k - 1),
                                  max_batch=1, max_k=3)
        chosen = []
        for r in range(8):  # requests of 70 steps, about 100 tokens each
            chosen += feed(policy, f"r{r}", 0.48, 70, random.Random(seed * 100 + r))
            policy.forget(f"r{r}")
        shares.append(sum(1 for k in chosen[140:] if k) / len(chosen[140:]))
    assert sum(shares) / len(shares) >= 0.5, shares


def test_high_acceptance_with_free_verification_chooses_the_maximum():
    policy = policy_with_cost(lambda rows: 1.0)
    chosen = feed(policy, "a", 0.98, 30, random.Random(0))
    assert chosen[-10:] == [MAX_K] * 10


def test_cost_growing_with_rows_lowers_k_as_concurrency_rises():
    # A step reads the weights once (fixed part) and then pays per verified row, as a compute-bound CPU does.
    policy = policy_with_cost(lambda rows: 1.0 + 0.08 * rows, max_batch=16)
    history = policy.estimate("history")  # every request has seen 70% of its drafts accepted at each position
    history.tried, history.accepted, history.prior_weight = [10.0] * MAX_K, [7.0] * MAX_K, [0.0] * MAX_K
    ks = []
    for batch in (1, 2, 4, 8, 16):
        cands = [Candidate(f"r{i}", 1000) for i in range(batch)]
        for c in cands:
            policy.acceptance.requests[c.request_id] = history
        choice = policy.choose(cands)
        assert len(set(choice)) == 1  # the same history: no request gains more than another from drafting
        ks.append(choice[0])
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1], ks
    assert ks[0] >= 3 and ks[-1] <= 1, ks


def test_collapsing_acceptance_lowers_k_within_a_few_steps():
    """A request moves from text the head predicts well (code) to text it does not (prose)."""
    policy = policy_with_cost(lambda rows: 1.0, lambda m, k: 0.15 * k)
    rng = random.Random(1)
    before = feed(policy, "a", 0.95, 30, rng)
    assert sum(before[-10:]) / 10 >= 5, before
    after = feed(policy, "a", 0.0, 20, rng)
    # Down within a few steps. Afterwards every other step tries a window again: plain steps age the request's
    # estimate back towards the engine-wide one, which here is this request's own good past.
    assert after[6] <= 2 and after[-10:].count(0) >= 5 and sum(after[-10:]) / 10 < MAX_K / 2, after


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unlucky_drafts_do_not_switch_off_a_head_that_pays(seed):
    """Drafts accepted independently at 55%: speculation pays at every step, and a couple of rejections in a row is
    luck, not a change of text. The request keeps drafting instead of falling back to plain steps after each."""
    policy = policy_with_cost(lambda rows: 1.0 + 0.01 * rows, lambda m, k: 0.25 + 0.02 * k)
    chosen = feed(policy, "a", 0.55, 400, random.Random(seed))[50:]
    assert chosen.count(0) < 0.06 * len(chosen), chosen


def test_requests_near_their_end_need_no_deep_window():
    policy = policy_with_cost(lambda rows: 1.0, lambda m, k: 0.05 * k)
    feed(policy, "a", 1.0, 30, random.Random(0))
    assert policy.choose([Candidate("a", 1000)]) == [MAX_K]
    assert policy.choose([Candidate("a", 3)]) == [2]  # 3 tokens left: 2 drafts and the target's own token


def test_requests_that_gain_draft_while_the_others_take_a_plain_step():
    """Verify rows are dear (cost grows with rows, as on a compute-bound CPU): only the requests whose drafts are
    accepted get a window; the rest decode plainly in the same forward, without rows of their own."""
    policy = policy_with_cost(lambda rows: 1.0 + 0.25 * rows)
    good, bad = policy.estimate("good"), policy.estimate("bad")
    good.tried, good.accepted, good.prior_weight = [10.0] * MAX_K, [9.5] * MAX_K, [0.0] * MAX_K
    bad.tried, bad.accepted, bad.prior_weight = [10.0] * MAX_K, [0.0] * MAX_K, [0.0] * MAX_K
    for b in range(1, 4):
        policy.acceptance.requests[f"good{b}"], policy.acceptance.requests[f"bad{b}"] = good, bad
    names = ["good1", "bad1", "good2", "bad2", "good3", "bad3", "good", "bad"]
    choice = policy.choose([Candidate(n, 1000) for n in names])
    assert [k for n, k in zip(names, choice) if n.startswith("bad")] == [0] * 4
    assert len({k for n, k in zip(names, choice) if n.startswith("good")}) == 1 and choice[0] >= 2, choice


def test_cost_model_follows_real_step_times():
    cost = ForwardCost(4, 3)
    timed = []
    cost.calibrate_decode(lambda rows: timed.append(rows) or 1.0 + 0.1 * rows, lambda m, k: 0.5 * m + 0.2 * k)
    assert set(timed) == {1, 2, 4, 8, 16}  # the rest is interpolated
    assert cost.predict(1) == pytest.approx(1.1)
    assert cost.predict(12) == pytest.approx(2.2)
    assert cost.predict(4, 1, 3) == pytest.approx(1.4 + 0.5 + 0.6)
    for _ in range(60):  # drafting one request at K = 3 turns out four times dearer than calibrated
        cost.observe(4, 1, 3, 1.4 + 4 * 1.1)
    assert cost.predict(4, 1, 3) == pytest.approx(5.8, rel=0.05)
    # Mostly charged to the drafter; the shared drift takes a little (one step time, two unknowns).
    assert cost.predict_target(4) < 1.3 * 1.4 and cost.predict_draft(1, 3) > 3 * 1.1
    assert cost.predict_draft(3, 1) > 1.5 * (0.5 * 3 + 0.2)  # drafting shapes never timed learn it too
    for _ in range(200):  # and then the whole machine slows down by half
        cost.observe(2, 0, 0, 1.5 * 1.2)
    assert cost.predict(2) == pytest.approx(1.8, rel=0.05)
    assert cost.predict(16) > 2.6 * 1.2  # cells never timed follow the drift


def test_plain_steps_probe_now_and_then():
    policy = policy_with_cost(lambda rows: 1.0, lambda m, k: 0.5 * k)
    chosen = feed(policy, "a", 0.0, 100, random.Random(0))
    probes = chosen[20:].count(1)
    assert 1 <= probes <= 6 and set(chosen[20:]) <= {0, 1}


def test_a_probe_drafts_for_one_request_only():
    """Re-measuring acceptance costs one verify row and one request's drafter pass, not a window for the batch."""
    policy = policy_with_cost(lambda rows: 1.0 + 0.1 * rows, lambda m, k: 0.2 * m * k)
    cands = [Candidate(f"r{i}", 1000) for i in range(6)]
    probes = []
    for _ in range(80):
        ks = policy.choose(cands)
        for c, k in zip(cands, ks):
            if k:
                policy.observe(c.request_id, k, 0)
        probes += [ks] if any(ks) else []
    assert len(probes) >= 2 and all(sorted(ks) == [0] * 5 + [1] for ks in probes[-2:]), probes


def test_a_model_free_draft_written_off_by_early_rejections_is_probed_back():
    """A suffix or n-gram draft's acceptance is capped by what its verified drafts measured; where verify rows are
    dear (4-bit weights on AVX2), early rejections put it below paying, and only a probe can show that the
    text now repeats."""
    from peagle.engine.policy import MeasuredAcceptance
    from peagle.engine.acceptance import Draft, survival

    policy = policy_with_cost(lambda rows: 1.0 + 0.3 * (rows - 1), max_k=8)
    measured, rid, chosen = MeasuredAcceptance(8), "r", []
    for step in range(300):
        conditional = [min(0.95, a) for a in measured.conditional(rid)]  # the tree is sure of its draft
        draft = Draft("suffix", list(range(8)), survival(conditional))
        [k] = policy.choose([Candidate(rid, 1000, draft)])
        accepted = 0 if len([c for c in chosen if c]) < 3 else k  # the first three drafts fail, then all pass
        measured.observe(rid, k, accepted)
        chosen.append(k)
    assert chosen[0] > 0 and chosen[1:16].count(0) >= 10  # written off at first
    assert sum(k >= 4 for k in chosen[-100:]) >= 90  # then long windows again


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="adaptive, fixed"):
        make_policy("greedy", ForwardCost(1, 3))


# -- the engine with the policy on --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> TargetModel:
    path = make_tiny_model(tmp_path_factory.mktemp("policy-tiny"), "llama", seed=1)
    return TargetModel.from_pretrained(path, dtype=torch.float32)


def engine(target: TargetModel, k: int, policy: str, parallel: bool = True, max_num_seqs: int = 4,
           max_model_len: int = 256, disable_by_batch_size: int | None = None) -> LLMEngine:
    head = random_head(target.config, target.embed_tokens.weight, "peagle" if parallel else "eagle3",
                       mask_token_id=3, seed=0, dtype=target.embed_tokens.weight.dtype)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=k, parallel_drafting=parallel,
                             disable_by_batch_size=disable_by_batch_size)
    return LLMEngine(target, None, head, spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     speculation_policy=policy)


def synthetic_costs(eng: LLMEngine, target, draft=no_drafter_cost) -> LLMEngine:
    """Step costs from formulas instead of this machine's timings, so which K the policy picks is reproducible."""
    eng.cost.calibrate_decode(target, draft)
    eng.cost.observe = lambda *timing: None
    return eng


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 512) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def half_right_oracle(eng: LLMEngine, reference: dict[tuple, list[int]]) -> None:
    """Drafts that are the true continuation for the first half of each answer and wrong after it: acceptance
    collapses mid-response, so the policy moves from deep windows to plain steps."""
    real_draft = eng.proposer.draft

    def draft(reqs, slots, k, *rest):
        drafts = real_draft(reqs, slots, k, *rest)[0].clone()
        for b, req in enumerate(reqs):
            ref = reference[tuple(req.prompt_ids)]
            for i in range(k):
                j = len(req.output_ids) + i
                tok = ref[j] if j < len(ref) else 0
                drafts[b, i] = tok if j < len(ref) // 2 else (tok + 1) % eng.target.config.vocab_size
        return drafts, None  # the oracle's chains: no candidates to shape trees from

    eng.proposer.draft = draft


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_adaptive_greedy_is_lossless(tiny_target, parallel):
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(tiny_target, None, max_num_seqs=8, max_model_len=256).generate(ps, params)]
    eng = synthetic_costs(engine(tiny_target, 7, "adaptive", parallel, max_num_seqs=3),
                          lambda rows: 1.0 + 0.1 * rows)
    half_right_oracle(eng, {tuple(p): r for p, r in zip(ps, ref)})
    outs = eng.generate(ps, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (48, 9, 48, 30, 1, 48)])
    for o, r, m in zip(outs, ref, (48, 9, 48, 30, 1, 48)):
        assert o.token_ids == r[:m]
    steps = eng.stats.steps_per_k
    assert steps[0] > 0 and sum(steps[2:]) > 0, steps  # plain steps and deep windows both happened
    assert eng.stats.mean_acceptance_length > 1.5


class Rotating(FixedK):
    """Request i verifies (step + i) % (K + 1) drafts: every step splits the batch into groups of different K."""

    def __init__(self, k: int):
        super().__init__(k)
        self.step = 0

    def choose(self, requests):
        self.step += 1
        return [(self.step + i) % (self.max_k + 1) for i in range(len(requests))]


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_steps_split_between_windows_are_lossless(tiny_target, parallel):
    ps = prompts(5, seed=17)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(tiny_target, None, max_num_seqs=5, max_model_len=256).generate(ps, params)]
    eng = engine(tiny_target, 3, "fixed", parallel, max_num_seqs=4)
    eng.policy = Rotating(3)
    half_right_oracle(eng, {tuple(p): r for p, r in zip(ps, ref)})
    forwards, per_step = [], []
    hook = eng.target.register_forward_hook(lambda module, args, out: forwards.append(args[0].shape))
    real_step = eng._decode_step

    def decode_step(plan):
        before = len(forwards)
        real_step(plan)
        per_step.append((len(forwards) - before, forwards[-1], sum(w.k + 1 for w in plan.windows)))

    eng._decode_step = decode_step
    try:
        assert [o.token_ids for o in eng.generate(ps, params)] == ref
    finally:
        hook.remove()
    assert all(n > 0 for n in eng.stats.steps_per_k), eng.stats.steps_per_k
    # Every step verified all its windows in one target forward, with exactly the rows they hold (no padding).
    assert all(n == 1 and shape.numel() == rows for n, shape, rows in per_step), per_step


def test_adaptive_logprobs_equal_plain_decoding(tiny_target):
    """Log-probabilities come from whichever forward verified each token: windows of any K and plain steps give
    the same numbers as plain decoding."""
    ps = prompts(4, seed=9)
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3)
    plain = LLMEngine(tiny_target, None, max_num_seqs=4, max_model_len=256).generate(ps, params)
    eng = synthetic_costs(engine(tiny_target, 5, "adaptive", max_num_seqs=4), lambda rows: 1.0 + 0.2 * rows)
    half_right_oracle(eng, {tuple(p): o.token_ids for p, o in zip(ps, plain)})
    outs = eng.generate(ps, params)
    assert eng.stats.steps_per_k[0] > 0 and sum(eng.stats.steps_per_k[1:]) > 0
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids and len(o.logprobs) == len(ref.logprobs) == 30
        for got, want in zip(o.logprobs, ref.logprobs):
            assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_adaptive_with_a_useless_head_decodes_plainly(tiny_target):
    ps = prompts(4, seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(tiny_target, None, max_num_seqs=4, max_model_len=256).generate(ps, params)]
    eng = synthetic_costs(engine(tiny_target, 7, "adaptive"), lambda rows: 1.0, lambda m, k: 0.1 * k)
    assert [o.token_ids for o in eng.generate(ps, params)] == ref
    steps = eng.stats.steps_per_k
    assert steps[0] > 0.6 * sum(steps), steps
    assert all(not r.backlog for r in eng.running)


def test_adaptive_sampling_keeps_the_target_distribution(small_vocab_target):  # noqa: F811
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(small_vocab_target, params)
    head = random_head(small_vocab_target.config, small_vocab_target.embed_tokens.weight, "peagle", mask_token_id=3,
                       seed=1, dtype=torch.float32)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=3, parallel_drafting=True)
    # every sample admitted at once; verification costs as much as a plain step whatever its rows, so the policy
    # speculates wherever drafts are accepted (this machine's timings, under load, could make it never draft)
    eng = synthetic_costs(LLMEngine(small_vocab_target, None, head, spec, max_num_seqs=256, max_model_len=32,
                                    speculation_policy="adaptive", max_num_batched_tokens=2048), lambda rows: 1.0)
    marginal2 = [sum(p for (a, _), p in exact.items() if a == t) for t in range(VOCAB)]
    marginal3 = [sum(p for (_, b), p in exact.items() if b == t) for t in range(VOCAB)]
    modes = {1: max(range(VOCAB), key=marginal2.__getitem__), 2: max(range(VOCAB), key=marginal3.__getitem__)}
    real_draft = eng.proposer.draft

    def draft(reqs, slots, k, *rest):
        drafts = real_draft(reqs, slots, k, *rest)[0].clone()
        for b, req in enumerate(reqs):
            for i in range(k):
                drafts[b, i] = modes.get(len(req.output_ids) + i, 0)
        return drafts, None  # the oracle's chains: no candidates to shape trees from

    eng.proposer.draft = draft
    counts = sample_joint(eng, params)
    assert sum(eng.stats.steps_per_k[1:]) > 0 and eng.stats.num_accepted_tokens > 0, eng.stats.as_dict()
    rejects, stat, crit = chi_square_rejects(counts, exact)
    assert not rejects, f"chi2 {stat:.1f} > critical {crit:.1f}: adaptive speculation changed the distribution"


class Scripted(FixedK):
    """K from a script, one entry per step (then the last one forever)."""

    def __init__(self, script: list[int]):
        super().__init__(max(script))
        self.script = list(script)

    def choose(self, requests):
        return [self.script.pop(0) if len(self.script) > 1 else self.script[0]] * len(requests)


def record_drafts(eng: LLMEngine) -> dict[int, list[int]]:
    """Every draft the engine makes, keyed by the request's committed token count when it was drafted."""
    seen: dict[int, list[int]] = {}
    real_draft = eng.proposer.draft

    def draft(reqs, slots, k, *rest):
        drafts, candidates = real_draft(reqs, slots, k, *rest)
        seen[reqs[0].num_tokens] = drafts[0].tolist()
        return drafts, candidates

    eng.proposer.draft = draft
    return seen


PENDING_CAP = 24  # max_pending_rows for the test below, so that a short request reaches it


@pytest.mark.parametrize("plain_steps", [5, PENDING_CAP - 1, PENDING_CAP + 3],
                         ids=["short", "resumes-right-after-the-cap", "past-the-pending-cap"])
@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_drafting_after_plain_steps_matches_always_drafting(tiny_target, parallel, plain_steps):
    prompt, k = prompts(1, seed=11)[0], 3
    params = SamplingParams(max_tokens=plain_steps + 12, ignore_eos=True)
    always = engine(tiny_target, k, "fixed", parallel, max_num_seqs=1)
    always_drafts = record_drafts(always)
    resumed = engine(tiny_target, k, "fixed", parallel, max_num_seqs=1)
    resumed.catch_up.max_pending_rows = PENDING_CAP
    resumed.policy = Scripted([k, k] + [0] * plain_steps + [k])
    resumed_drafts = record_drafts(resumed)
    assert always.generate([prompt], params)[0].token_ids == resumed.generate([prompt], params)[0].token_ids
    after = sorted(n for n in resumed_drafts if n > min(resumed_drafts) + plain_steps)
    assert after, "the scripted engine never drafted again"
    # The untrained head's drafts are rejected, one token per step in both engines, so the states line up.
    assert set(resumed_drafts) <= set(always_drafts)
    for n in after:
        assert resumed_drafts[n] == always_drafts[n], f"drafts differ at {n} tokens"
    assert resumed.stats.steps_per_k[0] == plain_steps


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_the_drafter_runs_only_for_heads_that_draft_and_within_the_memory_bound(tiny_target, parallel):
    """A request whose head never drafts never runs the drafter; a bound on its waiting rows makes the oldest run
    (all but the newest JOINT_PENDING_ROWS), and drafting later still matches an engine that always drafted."""
    prompt, k = prompts(1, seed=11)[0], 3
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = engine(tiny_target, k, "fixed", parallel, max_num_seqs=1).generate([prompt], params)[0].token_ids
    drafter_rows = []

    def count_rows(module, args, out):
        drafter_rows.append(args[0].shape[1])

    never = engine(tiny_target, k, "fixed", parallel, max_num_seqs=1)
    never.policy = Scripted([0])
    hook = never.drafter.register_forward_hook(count_rows)
    assert never.generate([prompt], params)[0].token_ids == ref
    hook.remove()
    assert drafter_rows == []
    bounded = engine(tiny_target, k, "fixed", parallel, max_num_seqs=1)
    bounded.catch_up.max_pending_rows = PENDING_CAP
    bounded.policy = Scripted([0] * 50 + [k])
    hook = bounded.drafter.register_forward_hook(count_rows)
    req_id = bounded.add_request(prompt, params)
    got = []
    while bounded.has_work():
        for out in bounded.step():
            assert out.request_id == req_id
            got = out.token_ids
        assert all(len(r.backlog) <= PENDING_CAP + k + 1 for r in bounded.running)  # + this step's rows
    hook.remove()
    assert got == ref
    assert drafter_rows and min(drafter_rows[:2]) >= PENDING_CAP - engine_module.JOINT_PENDING_ROWS, drafter_rows


def test_metrics_expose_k_per_step():
    from peagle.engine import SpecDecodeStats
    from peagle.serve.metrics import Metrics

    metrics = Metrics("m", 3)
    stats = SpecDecodeStats(3)
    for k, a in ((0, 0), (0, 0), (3, 2), (1, 1)):
        stats.record(k, a)
    metrics.record_spec(stats)
    metrics.record_spec(stats)  # no new steps: nothing observed twice
    text = metrics.render(0, 0).decode()
    assert 'peagle:spec_decode_num_speculative_tokens_count{model_name="m"} 4.0' in text
    assert 'peagle:spec_decode_num_speculative_tokens_sum{model_name="m"} 4.0' in text
    assert 'peagle:spec_decode_num_speculative_tokens_bucket{le="0.0",model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 2.0' in text


def test_serve_defaults_to_adaptive_and_reads_the_environment():
    import argparse

    from peagle.serve.cli import add_serve_args, apply_env_defaults

    def parse(environ, argv=()):
        parser = argparse.ArgumentParser()
        add_serve_args(parser)
        apply_env_defaults(parser, environ)
        return parser.parse_args(list(argv)).speculation_policy

    assert parse({}) == "adaptive"
    assert parse({"SM_VLLM_SPECULATION_POLICY": "fixed"}) == "fixed"
    assert parse({"SM_VLLM_SPECULATION_POLICY": "fixed"}, ["--speculation-policy", "adaptive"]) == "adaptive"


def test_generate_reports_the_policy(capsys, one_thread):
    import json

    from peagle.cli import main

    assert main(["generate", "--json", "--max-tokens", "12", "def add(a, b):"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculation_policy"] == "adaptive" and out["method"] == "hybrid"  # the default: head + suffix
    assert set(out["proposers"]) == {"peagle", "suffix"}
    assert sum(out["steps_per_k"]) > 0 and len(out["steps_per_k"]) == out["num_speculative_tokens"] + 1
    assert main(["generate", "--json", "--max-tokens", "12", "--speculation-policy", "fixed", "def add(a, b):"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert fixed["speculation_policy"] == "fixed" and fixed["text"] == out["text"]
    assert fixed["steps_per_k"][0] == 0  # every step drafts: the head's K, or the suffix tree's whole draft


def test_disable_by_batch_size_turns_speculation_off_while_the_batch_is_large(tiny_target):
    ps = prompts(3, seed=13)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 20, 20)]
    ref = [o.token_ids for o in LLMEngine(tiny_target, None, max_num_seqs=3, max_model_len=256).generate(ps, params)]
    eng = engine(tiny_target, 3, "fixed", max_num_seqs=3, disable_by_batch_size=3)
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == ref
    # Plain steps while all three run; drafts again once the short request has finished.
    assert outs[0].spec_stats.steps_per_k == [5, 0, 0, 0] and outs[1].spec_stats.steps_per_k[3] > 0  # (the prefill made token 1)
