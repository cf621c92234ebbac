"""The grammar module on SmolLM2's tokenizer: constraints compile once and fail with a message naming the field,
the matcher's masks follow its state through advance and rollback, forced tokens are the only ones allowed, and a
speculation window keeps what was committed and rolls back the rest."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from peagle.engine.grammar import (MAX_CONSTRAINT_CHARS, Constraint, GrammarCompiler, GrammarError, GrammarWindow,
                                   count_forced, stack_bias)
from peagle.model.loading import embedded_model_dir, load_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# Bounded, so a walk with fixed scores ends.
SHORT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 150}},
         "required": ["name", "age"], "additionalProperties": False}
VOCAB, EOS = 49152, 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_dir())


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, [EOS])


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def greedy_walk(matcher, scores: torch.Tensor, limit: int = 60) -> list[int]:
    """Decode under the matcher with fixed per-token scores (the best allowed token each step) until EOS."""
    out = []
    while len(out) < limit:
        tok = int(matcher.mask_logits(scores).argmax())
        out.append(tok)
        matcher.commit([tok])
        if tok == EOS:
            break
    return out


def test_schema_masks_follow_the_state(tok, compiler):
    m = compiler.matcher(Constraint.json_schema(PERSON))
    text = '{"name": "Bob", "age": 42}'
    for t in ids(tok, text):
        assert m.allowed()[t], f"token {tok.decode([t])!r} refused"
        assert not m.allowed()[EOS]  # the end of sequence only where the schema is satisfied
        m.advance([t])
    assert m.accepting and m.terminated
    assert m.forced_token() == EOS
    m.rollback(3)  # back inside the number: more digits are allowed again, the end is not
    assert not m.accepting and m.allowed()[ids(tok, "7")[0]] and not m.allowed()[EOS]


def test_masks_are_cached_per_state_and_survive_a_kept_proposal(tok, compiler):
    m = compiler.matcher(Constraint.json_schema(PERSON))
    first = m.mask()
    assert m.mask() is first  # computed once per state
    w = GrammarWindow(m)
    draft_vocab = torch.arange(VOCAB)
    scores = torch.zeros(VOCAB)
    scores[ids(tok, '{"')[0]] = 5.0
    d1 = w.propose(scores, draft_vocab)
    assert d1 == ids(tok, '{"')[0]
    d2 = w.propose(torch.zeros(VOCAB), draft_vocab)  # the key's first token is forced here
    assert d2 == w.proposed[1] and len(w.proposed) == 2
    masks = w.masks()
    assert len(masks) == 3 and count_forced(masks, 3) >= 1 and stack_bias(masks).shape == (3, VOCAB)
    assert masks[1].forced == d2 and masks[1].num_allowed == 1 and int((masks[1].bias == 0).sum()) == 1
    kept = m._masks[1]
    w.settle([d1])  # the answer stopped after d1 (max_tokens): the second is rolled back, d1 and its mask kept
    assert m.num_tokens == 1 and m._masks[1] is kept
    assert list(m._masks) == [1]  # only the current state's mask is kept
    assert m.forced_token() == d2


def test_propose_never_leaves_the_grammar_and_stops_when_it_ends(tok, compiler):
    m = compiler.matcher(Constraint.choice(["yes", "no"]))
    w = GrammarWindow(m)
    rng = torch.Generator().manual_seed(0)
    drafts = []
    while (t := w.propose(torch.randn(VOCAB, generator=rng), torch.arange(VOCAB))) is not None:
        drafts.append(t)
    assert tok.decode(drafts) in ("yes", "no") and m.terminated


def test_propose_stops_where_the_draft_vocabulary_has_nothing_allowed(tok, compiler):
    m = compiler.matcher(Constraint.regex(r"[0-9]{3}"))
    w = GrammarWindow(m)
    letters_only = torch.tensor(ids(tok, "abc xyz hello"))
    assert w.propose(torch.zeros(len(letters_only)), letters_only) is None
    assert w.proposed == [] and w.propose(torch.zeros(len(letters_only)), letters_only) is None


@pytest.mark.parametrize("constraint,check", [
    (Constraint.json_schema(SHORT), lambda s: jsonschema.validate(json.loads(s), SHORT) is None),
    (Constraint.json_schema({"type": "object", "properties": {"colour": {"enum": ["red", "green"]}},
                             "required": ["colour"], "additionalProperties": False}),
     lambda s: json.loads(s)["colour"] in ("red", "green")),
    (Constraint.regex(r"[A-Z][a-z]{2,5} [0-9]{2}"), lambda s: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", s)),
    (Constraint.choice(["red", "green", "blue"]), lambda s: s in ("red", "green", "blue")),
    (Constraint.grammar('root ::= "(" [a-c]{1,4} ")"'), lambda s: re.fullmatch(r"\([a-c]{1,4}\)", s)),
], ids=["json_schema", "enum", "regex", "choice", "gbnf"])
def test_every_kind_decodes_to_a_match(tok, compiler, constraint, check):
    rng = torch.Generator().manual_seed(1)
    scores = torch.randn(VOCAB, generator=rng)
    scores[EOS] = 3.0  # ends as soon as it may: answers stay short
    out = greedy_walk(compiler.matcher(constraint), scores)
    assert out[-1] == EOS
    assert check(tok.decode(out[:-1]))


@pytest.mark.parametrize("constraint,needle", [
    (lambda: Constraint.json_schema({"type": "wibble"}), "wibble"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.regex("[a-"), "regex"),
    (lambda: Constraint.grammar("root ::= undefined_rule"), "undefined_rule"),
    (lambda: Constraint.choice([]), "non-empty"),
    (lambda: Constraint.regex("a" * (MAX_CONSTRAINT_CHARS + 1)), "limit"),
])
def test_bad_constraints_name_the_problem(compiler, constraint, needle):
    with pytest.raises(GrammarError) as e:
        compiler.matcher(constraint())
    assert needle in str(e.value) and e.value.param


def test_compiled_once_and_copied(compiler):
    c = Constraint.json_schema({"type": "object", "properties": {"x": {"enum": ["a", "b"]}}})
    a = compiler.matcher(c)
    same = Constraint.json_schema(json.dumps({"type": "object", "properties": {"x": {"enum": ["a", "b"]}}}, indent=2))
    assert same == c and compiler._cache[same] is compiler._cache[c]
    b = compiler.matcher(same)
    a.advance([compiler.tokenizer.tokenize_str('{"')[0]])
    assert b.num_tokens == 0 and a._m is not b._m  # each request has its own state


def wide_schema(num_properties: int) -> dict:
    """An object with many distinct properties, each an enum of strings: big to compile, valid."""
    return {"type": "object", "additionalProperties": False,
            "properties": {f"field_{i}": {"enum": [f"v{i}_{j}" for j in range(20)]} for i in range(num_properties)}}


def test_a_schema_over_the_size_limit_is_refused_before_compiling(compiler):
    schema = wide_schema(2000)
    assert len(json.dumps(schema)) > MAX_CONSTRAINT_CHARS
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="limit"):
        compiler.matcher(Constraint.json_schema(schema))
    assert time.perf_counter() - start < 1.0


def test_a_compile_past_the_time_limit_is_refused(tok):
    compiler = GrammarCompiler(tok, VOCAB, [EOS], timeout_s=0.001)
    with pytest.raises(GrammarError, match="to compile") as e:
        compiler.matcher(Constraint.json_schema(wide_schema(150)))
    assert e.value.param == "response_format" and not compiler._cache
