"""Greedy speculation equals plain greedy decoding, token for token, on the embedded SmolLM2 with its bundled heads:
both methods, K in {1, 3, 7} and draft trees, batches of 1-8 requests that join while others are decoding, steps
whose requests verify windows of different sizes in one ragged forward, on every matrix path this machine runs (the AVX2 path runs on every x86-64 machine these tests target).

This holds because peagle's kernels compute every row of a verify window exactly as a one-row decode step would
(docs/design.md, "Decoding step"); it is skipped only off x86-64 CPUs with AVX2, where they do not run.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model.checkpoint import load_head
from peagle.model.heads import DEFAULT_HEADS, resolve_head
from peagle.model.target import TargetModel
from tests.conftest import KERNEL_PATHS, needs_native_kernels
from tests.test_policy import Rotating

PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "List three colours.", "Explain recursion in one sentence.", "Translate 'good morning' into Spanish.",
           "def fibonacci(n):", "Give me a haiku about the sea.", "What is 17 times 3?"]
MAX_TOKENS = 20
# (method, K, batch size): every K for both methods, batch sizes from 1 to 8
CASES = [("peagle", 1, 8), ("peagle", 3, 3), ("peagle", 7, 5), ("eagle3", 1, 2), ("eagle3", 3, 8), ("eagle3", 7, 1),
         ("peagle", "0-3 per request", 6), ("eagle3", "0-3 per request", 4)]
# draft trees (docs/design.md, "Draft trees"): P-EAGLE's best 8 nodes of 3 depths, EAGLE-3's chain with side leaves
TREES = {"peagle": {"draft_tree_nodes": 8}, "eagle3": {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), "
                                                                             "(0, 0, 0), (0, 0, 1)]"}}
CASES += [("peagle", "tree", 4), ("eagle3", "tree", 3)]


def run_staggered(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    """Submit the prompts a few at a time while earlier ones decode, and return each one's tokens."""
    ids, outputs, pending = [], {}, list(PROMPTS)
    while pending or engine.has_work():
        if pending:  # two new requests every other step: they join a running batch mid-flight
            ids += [engine.add_request(p, params, chat=True) for p in pending[:2]]
            pending = pending[2:]
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        if pending:
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids
    return [outputs[i] for i in ids]


@needs_native_kernels
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_greedy_speculation_equals_plain_greedy_on_smollm2(path, smollm2_dir, one_thread):
    target = TargetModel.from_pretrained(smollm2_dir).pack_(path)
    assert target.lm_head_packed.path == path
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    alone = LLMEngine(target, tok, max_num_seqs=1, max_model_len=256)  # each request alone: the reference
    reference = [alone.generate([p], params, chat=True)[0].token_ids for p in PROMPTS]
    heads = {m: load_head(resolve_head(DEFAULT_HEADS[m]), target.embed_tokens.weight) for m in DEFAULT_HEADS}
    for head in heads.values():
        head.pack_()
    for method, k, batch in CASES:
        assert_case_lossless(target, tok, heads[method], method, k, batch, reference, path)


def assert_case_lossless(target: TargetModel, tok, head, method: str, k, batch: int, reference: list[list[int]],
                         label: str) -> None:
    """One of CASES: the prompts through a speculative engine of `batch` slots, against each one decoded alone."""
    spec = SpeculativeConfig.parse({"model": DEFAULT_HEADS[method], "method": "eagle3",
                                    "num_speculative_tokens": k if isinstance(k, int) else 3,
                                    "parallel_drafting": method == "peagle", **(TREES[method] if k == "tree" else {})})
    engine = LLMEngine(target, tok, head, spec, max_num_seqs=batch, max_model_len=256, speculation_policy="fixed")
    if k == "0-3 per request":  # request i verifies (step + i) % 4 drafts: every step mixes window sizes
        engine.policy = Rotating(3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    assert run_staggered(engine, params) == reference, f"{label}: {method} K={k} batch {batch}"
    assert engine.stats.num_accepted_tokens > 0  # drafts were accepted: rollback and bonus tokens exercised
