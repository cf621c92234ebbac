"""Structured outputs through the engine stay lossless: greedy constrained output with speculation (both methods, K
1/3/7, batches mixing constrained and free requests, drafts accepted and rejected, a reduced draft vocabulary,
forced tokens verified after the drafts) equals token-by-token constrained decoding; constrained sampling keeps the
constrained target distribution; answers match their constraint, end only where it allows, and "length" when cut."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.grammar import Constraint
from peagle.model.checkpoint import random_head
from peagle.model.target import TargetModel
from tests.serve_util import build_tiny
from tests.test_sampling import small_vocab_target  # noqa: F401 - a fixture

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "colour", "count"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
CONSTRAINTS = [Constraint.json_schema(SCHEMA), None, Constraint.regex(r"(yes|no), [a-z]{1,6}\."),
               Constraint.choice(["alpha", "beta", "gamma delta"]), None, Constraint.json_object(),
               Constraint.grammar('root ::= "[" [0-9]+ ("," [0-9]+)* "]"'), Constraint.json_schema(SCHEMA)]
PROMPTS = ["Describe a cat as JSON.", "Tell me a story.", "Is water wet?", "Pick a word.", "Count to five.",
           "Give me an object.", "List numbers.", "Describe a dog as JSON."]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[TargetModel, object]:
    model_dir, _ = build_tiny(Path(tmp_path_factory.mktemp("structured")))
    engine = LLMEngine.from_pretrained(str(model_dir), None, device="cpu", dtype="float32")
    return engine.target, engine.tokenizer


def params(constraint, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, constraint=constraint)


def engine_for(tiny, k: int = 0, parallel: bool = True, head=None, max_num_seqs: int = 4,
               policy: str = "fixed", **engine_args) -> LLMEngine:
    target, tok = tiny
    if k == 0:
        return LLMEngine(target, tok, max_num_seqs=max_num_seqs, max_model_len=256)
    head = head or random_head(target.config, target.embed_tokens.weight, "peagle" if parallel else "eagle3",
                               mask_token_id=3, seed=2, dtype=torch.float32)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=k, parallel_drafting=parallel)
    return LLMEngine(target, tok, head, spec, max_num_seqs=max_num_seqs, max_model_len=256,
                     speculation_policy=policy, **engine_args)


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    """Token-by-token constrained decoding: no drafter, no forced tokens verified ahead, one request at a time."""
    engine = engine_for(tiny, max_num_seqs=1)
    engine.max_forced_run = 0
    return [engine.generate([p], params(c), chat=True)[0].token_ids for p, c in zip(PROMPTS, CONSTRAINTS)]


def check_match(text: str, constraint: Constraint | None) -> None:
    if constraint is None:
        return
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.spec))
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.spec, text), text
    elif constraint.kind == "choice":
        assert text in json.loads(constraint.spec)
    else:
        assert re.fullmatch(r"\[[0-9]+(,[0-9]+)*\]", text), text


def test_reference_answers_match_their_constraints(tiny, reference):
    tok = tiny[1]
    finished = 0
    for ids, c in zip(reference, CONSTRAINTS):
        if c is not None and ids[-1] == 2:  # ended by the grammar's end of sequence
            check_match(tok.decode(ids[:-1]), c)
            finished += 1
        elif c is not None:
            assert len(ids) == MAX_TOKENS  # otherwise cut by max_tokens
    assert finished >= 3  # the choice, the regex and the schema's bounded answers end on their own


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_constrained_greedy_speculation_is_lossless(tiny, reference, k, parallel):
    engine = engine_for(tiny, k, parallel, max_num_seqs=3)  # 8 requests through 3 slots: joins mid-flight
    outs = engine.generate(PROMPTS, [params(c) for c in CONSTRAINTS], chat=True)
    assert [o.token_ids for o in outs] == reference
    assert engine.stats.num_forced_tokens > 0


def test_adaptive_policy_under_grammars_is_lossless(tiny, reference):
    """The adaptive policy picks K per request from 0 up (plain steps verify forced runs alone)."""
    engine = engine_for(tiny, 3, True, max_num_seqs=3, policy="adaptive")
    outs = engine.generate(PROMPTS, [params(c) for c in CONSTRAINTS], chat=True)
    assert [o.token_ids for o in outs] == reference


def grammar_oracle(engine: LLMEngine, reference: dict[tuple, list[int]], wrong_every: int = 3) -> LLMEngine:
    """Drafter logits that favour the true continuation, wrong at every `wrong_every`-th position (where the grammar
    may then pick any allowed token): drafts under the grammar are accepted, partly accepted and rejected, so the
    matcher is rolled back at every depth."""
    drafter, context = engine.drafter, {}
    real_draft, real_logits = engine.proposer.draft, drafter.logits

    def draft(reqs, slots, k, *rest):
        context["reqs"] = reqs
        return real_draft(reqs, slots, k, *rest)

    def logits(hidden):
        out = real_logits(hidden)
        depths = out.shape[1]
        for b, req in enumerate(context["reqs"]):
            ref = reference[tuple(req.prompt_ids)]
            for i in range(depths):
                j = len(req.output_ids) + i
                tok = ref[j] if j < len(ref) else 0
                if (j + b) % wrong_every == wrong_every - 1:
                    tok = (tok + 1) % out.shape[-1]
                out[b, i] = 0.0
                out[b, i, tok] = 10.0
        return out

    engine.proposer.draft, drafter.logits = draft, logits
    return engine


@pytest.mark.parametrize("k", [3, 7])
def test_rollback_after_rejected_drafts_under_a_grammar(tiny, reference, k):
    """P-EAGLE (its K logits come from one pass, so the oracle knows each depth's position)."""
    encoder = engine_for(tiny)
    engine = grammar_oracle(engine_for(tiny, k, True, max_num_seqs=4),
                            {tuple(encoder.encode_prompt(p, True)): r for p, r in zip(PROMPTS, reference)})
    outs = engine.generate(PROMPTS, [params(c) for c in CONSTRAINTS], chat=True)
    assert [o.token_ids for o in outs] == reference
    s = engine.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # accepted and rejected drafts both happened
    assert s.mean_acceptance_length > 1.5


def test_reduced_draft_vocabulary_maps_through_d2t(tiny, reference):
    """A head whose draft vocabulary is a subset of the target's: drafts under the mask are mapped to target ids,
    and depths where nothing allowed is in the subset stop drafting."""
    target, _ = tiny
    head = random_head(target.config, target.embed_tokens.weight, "peagle", mask_token_id=3, seed=5,
                       dtype=torch.float32)
    used = torch.cat([torch.arange(0, 300), torch.arange(1000, 49152, 7)]).unique()
    with torch.no_grad():
        head.lm_head = torch.nn.Linear(head.config.hidden_size, len(used), bias=False)
        head.lm_head.weight.copy_(target.lm_head_weight[used].float())  # drafts that resemble the target's
    head.config.draft_vocab_size = len(used)
    head.d2t = used - torch.arange(len(used))
    engine = engine_for(tiny, 3, True, head=head)
    outs = engine.generate(PROMPTS, [params(c) for c in CONSTRAINTS], chat=True)
    assert [o.token_ids for o in outs] == reference


def test_forced_tokens_save_steps_and_change_nothing(tiny, reference):
    """With no drafter at all, forced runs (keys, punctuation, the end of sequence) are verified in one forward."""
    engine = engine_for(tiny, max_num_seqs=1)
    steps = 0
    outs = []
    for p, c in zip(PROMPTS, CONSTRAINTS):
        engine.add_request(p, params(c), chat=True)
        while engine.has_work():
            steps += 1
            outs += [o.token_ids for o in engine.step() if o.finished]
    assert outs == reference
    assert engine.stats.num_forced_tokens > 0
    assert steps < sum(len(r) for r in reference) - engine.stats.num_forced_tokens // 2


def test_cut_by_max_tokens_ends_with_length_and_eos_waits_for_the_grammar(tiny):
    engine = engine_for(tiny, 3, True)
    out = engine.generate(["Describe a cat as JSON."], params(Constraint.json_schema(SCHEMA), max_tokens=4),
                          chat=True)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and 2 not in out.token_ids
    # ignore_eos cannot run an answer past the grammar's end
    p = SamplingParams(max_tokens=MAX_TOKENS, constraint=Constraint.choice(["alpha", "beta"]), ignore_eos=True)
    out = engine.generate(["Pick."], p, chat=True)[0]
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")


def test_constrained_sampling_is_seeded_and_valid(tiny):
    # A seed reproduces a text for the same drafts; the step's time budget can cut the drafter's catch-up (and so
    # a step's window) on a loaded machine, so this engine's budget never binds.
    engine = engine_for(tiny, 3, True, max_step_time_ms=1e6)
    c = Constraint.regex(r"(yes|no), [a-z]{1,6}\.")
    ps = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, constraint=c) for i in range(6)]
    a = [o.text for o in engine.generate(["Is water wet?"] * 6, ps, chat=True)]
    b = [o.text for o in engine.generate(["Is water wet?"] * 6, ps, chat=True)]
    assert a == b and len(set(a)) > 1
    for text in a:
        assert re.fullmatch(c.spec, text), text


# -- sampling under a constraint keeps the constrained target distribution (an 8-token vocabulary: exact) ----------

LETTERS = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("abcdefg")}}
REGEX = "[a-c][a-e][a-g]"  # position 1: ids 1-3, position 2: ids 1-5, position 3: ids 1-7
ALLOWED = [list(range(1, 4)), list(range(1, 6)), list(range(1, 8))]


def letters_tokenizer():
    """A byte-level tokenizer whose 8 tokens are the end of sequence and the letters a-g."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=LETTERS, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def constrained_joint(target, params: SamplingParams, constrained: bool) -> dict[tuple, float]:
    """P(t2, t3 | prompt), marginalising t1, each position's logits masked to ALLOWED (or not) before processing."""
    from peagle.engine.sampling import target_probs
    from peagle.model.layers import BatchLayout
    from tests.test_sampling import PROMPT, VOCAB

    cache = target.new_cache(1, 32)

    def probs(prefix: list[int], pos: int) -> torch.Tensor:
        n = len(prefix)
        logits = target(torch.tensor([prefix]), BatchLayout.build(torch.tensor([0]), torch.arange(n)[None]),
                        cache).logits[0, -1]
        if constrained:
            keep = torch.full((VOCAB,), float("-inf"))
            keep[ALLOWED[pos]] = 0.0
            logits = logits.float() + keep
        return target_probs(logits, params)

    joint: dict[tuple, float] = {}
    p1 = probs(PROMPT, 0)
    for t1 in range(VOCAB):
        if p1[t1] == 0:
            continue
        p2 = probs(PROMPT + [t1], 1)
        for t2 in range(VOCAB):
            if p2[t2] == 0:
                continue
            p3 = probs(PROMPT + [t1, t2], 2)
            for t3 in range(VOCAB):
                if p3[t3] > 0:
                    joint[(t2, t3)] = joint.get((t2, t3), 0.0) + float(p1[t1] * p2[t2] * p3[t3])
    return joint


def test_constrained_speculative_sampling_keeps_the_constrained_distribution(small_vocab_target):
    """Temperature, top-k and top-p all on (the grammar's mask comes first, as in constrained decoding)."""
    from tests.test_sampling import VOCAB, chi_square_rejects, sample_joint

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=4)

    exact = constrained_joint(small_vocab_target, params, constrained=True)
    head = random_head(small_vocab_target.config, small_vocab_target.embed_tokens.weight, "peagle", mask_token_id=3,
                       seed=1, dtype=torch.float32)
    spec = SpeculativeConfig(model="random", num_speculative_tokens=3, parallel_drafting=True)
    engine = LLMEngine(small_vocab_target, letters_tokenizer(), head, spec, max_num_seqs=256, max_model_len=32,
                       speculation_policy="fixed", max_num_batched_tokens=2048)  # every sample admitted at once
    # drafter logits that favour each position's most likely allowed token: drafts accepted and rejected
    marginal = [{t: sum(p for (a, b), p in exact.items() if (a, b)[i - 1] == t) for t in range(VOCAB)}
                for i in (1, 2)]
    modes = {0: ALLOWED[0][0], 1: max(marginal[0], key=marginal[0].get), 2: max(marginal[1], key=marginal[1].get)}
    context, real_draft = {}, engine.proposer.draft

    def draft(reqs, slots, k, *rest):
        context["reqs"] = reqs
        return real_draft(reqs, slots, k, *rest)

    def logits(hidden):
        out = torch.zeros(hidden.shape[0], hidden.shape[1], VOCAB)
        for b, req in enumerate(context["reqs"]):
            for i in range(hidden.shape[1]):
                out[b, i, modes.get(len(req.output_ids) + i, 0)] = 5.0
        return out

    engine.proposer.draft, engine.drafter.logits = draft, logits
    counts = sample_joint(engine, params, ignore_eos=False, constraint=Constraint.regex(REGEX))
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    rejects, stat, crit = chi_square_rejects(counts, exact)
    assert not rejects, f"chi2 {stat:.1f} > critical {crit:.1f}: speculation changed the constrained distribution"
    # and the test can tell the constrained distribution from the unconstrained one
    assert chi_square_rejects(counts, constrained_joint(small_vocab_target, params, constrained=False))[0]


def test_a_matcher_that_fails_mid_answer_ends_only_its_request(tiny, reference):
    """llguidance in an error state (as when a grammar exhausts its per-step limits): that request ends at once,
    reported as aborted; the others in its batch are untouched."""
    engine = engine_for(tiny, 3, True, max_num_seqs=8)
    ids = [engine.add_request(p, params(c), chat=True) for p, c in zip(PROMPTS, CONSTRAINTS)]
    final = {o.request_id: o for o in engine.step() if o.finished}
    broken = next(r for r in engine.running if r.request_id == ids[0])
    broken.matcher._m.consume_token(2)  # the end of sequence, refused inside the object: llguidance's error state
    while engine.has_work():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final[ids[0]].finish_reason == "abort" and len(final[ids[0]].token_ids) <= 3 + 4
    assert [final[i].token_ids for i in ids[1:]] == reference[1:]
