"""Structured outputs on the embedded SmolLM2 with its bundled heads: greedy constrained speculation (P-EAGLE and
EAGLE-3 at K 1/3/7, batches mixing constrained and free requests that join mid-flight) equals token-by-token
constrained decoding without a drafter, and the model's answers validate against their schemas."""
from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.grammar import Constraint
from peagle.model.checkpoint import load_head
from peagle.model.heads import DEFAULT_HEADS, resolve_head
from peagle.model.target import TargetModel
from tests.conftest import needs_native_kernels

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40}}}
REQUESTS = [
    ("Alice is 31 and lives in Paris. Give her details as JSON with name, age and city.",
     Constraint.json_schema(PERSON)),
    ("What is the capital of France?", None),
    ("Is the sky blue? Answer yes or no.", Constraint.choice(["yes", "no"])),
    ("Bob, 45, from Berlin. Reply with JSON: name, age, city.", Constraint.json_schema(PERSON)),
    ("List three colours.", None),
    ("Give today's date in ISO form.", Constraint.regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
]
MAX_TOKENS = 40
CASES = [("peagle", 1), ("peagle", 3), ("peagle", 7), ("eagle3", 1), ("eagle3", 3), ("eagle3", 7)]


def run_staggered(engine: LLMEngine) -> list[list[int]]:
    ids, outputs, pending = [], {}, list(REQUESTS)
    while pending or engine.has_work():
        if pending:  # two new requests every step: they join a running batch mid-flight
            ids += [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, constraint=c), chat=True)
                    for p, c in pending[:2]]
            pending = pending[2:]
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return [outputs[i] for i in ids]


@needs_native_kernels
def test_constrained_speculation_is_lossless_on_smollm2(smollm2_dir, one_thread):
    target = TargetModel.from_pretrained(smollm2_dir).pack_()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    alone = LLMEngine(target, tok, max_num_seqs=1, max_model_len=512)
    alone.max_forced_run = 0  # the reference: one token per step, each under its mask
    reference = [alone.generate([p], SamplingParams(max_tokens=MAX_TOKENS, constraint=c), chat=True)[0]
                 for p, c in REQUESTS]
    for out, (_, c) in zip(reference, REQUESTS):
        if c is not None and c.kind == "json_schema":
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), PERSON)
    heads = {m: load_head(resolve_head(DEFAULT_HEADS[m]), target.embed_tokens.weight) for m in DEFAULT_HEADS}
    for head in heads.values():
        head.pack_()
    for method, k in CASES:
        spec = SpeculativeConfig.parse({"model": DEFAULT_HEADS[method], "method": "eagle3",
                                        "num_speculative_tokens": k, "parallel_drafting": method == "peagle"})
        engine = LLMEngine(target, tok, heads[method], spec, max_num_seqs=4, max_model_len=512,
                           speculation_policy="fixed")
        outs = run_staggered(engine)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference], f"{method} K={k}"
        assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_forced_tokens > 0
