"""The bundled SmolLM2 heads: they load, they are the defaults, their drafts are good enough to be worth serving,
and speculating with them changes nothing in the output.

The floors sit below what these prompts measured when the heads were trained (docs/heads.md has the full
measurement); a head that regresses to guessing falls far under them."""
from __future__ import annotations

import pytest

from peagle.engine.engine import LLMEngine
from peagle.engine.sampling import SamplingParams
from peagle.model.heads import DEFAULT_HEADS, DEFAULT_NUM_SPECULATIVE_TOKENS, HEADS_DIR, bundled_heads
from peagle.model.speculation import resolve_speculation

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same forwards and backwards.\"\"\"",
    "What are three tips for staying healthy?",
    "Explain what a hash table is in two sentences.",
]
MAX_TOKENS = 64
# Mean acceptance length on PROMPTS when the bundled heads were made (about the same at K = 3 and 7: these heads'
# drafts past the third position are rarely accepted yet), and the floor each head must stay above (about 0.1 under,
# room for the greedy text of another CPU's kernels). An untrained head scores 1.00.
MEASURED = {"peagle": 1.41, "eagle3": 1.39}
FLOOR = {"peagle": 1.30, "eagle3": 1.29}


@pytest.fixture(scope="module")
def plain_outputs(one_thread) -> list[list[int]]:
    engine = LLMEngine.from_pretrained(None, None, max_num_seqs=len(PROMPTS), device="cpu")
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), chat=True)]


def test_heads_are_bundled_and_default():
    assert set(DEFAULT_HEADS.values()) <= set(bundled_heads())
    chosen = resolve_speculation(None)
    spec = chosen.config
    assert chosen.origin == "default" and chosen.method == "hybrid" and spec.parallel_drafting
    assert chosen.head_path == HEADS_DIR / DEFAULT_HEADS["peagle"] and spec.model == str(chosen.head_path)
    assert spec.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS


@pytest.mark.parametrize("method,k", [(m, k) for m in MEASURED for k in (3, 7)])
def test_bundled_head_quality_and_lossless(method, k, plain_outputs):
    spec = {"model": DEFAULT_HEADS[method], "method": "eagle3", "num_speculative_tokens": k,
            "parallel_drafting": method == "peagle"}
    engine = LLMEngine.from_pretrained(None, spec, max_num_seqs=len(PROMPTS), device="cpu", speculation_policy="fixed")
    assert engine.drafter.config.parallel_capable == (method == "peagle")
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), chat=True)
    assert [o.token_ids for o in outs] == plain_outputs
    mal = engine.stats.mean_acceptance_length
    floor = FLOOR[method]
    assert mal >= floor, (f"{method} K={k}: mean acceptance length {mal:.2f} is under the floor {floor} "
                          f"(measured {MEASURED[method]} when the head was made): the bundled head regressed")
