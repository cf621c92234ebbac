"""Streaming detokenization gives exactly the text of decoding the whole output: multi-byte characters split across
tokens are held back until whole, and stop strings that span tokens cut the text where the whole decode would."""
from __future__ import annotations

import random

import pytest
import torch

from peagle.engine import LLMEngine, SamplingParams
from peagle.engine.detokenize import REPLACEMENT, IncrementalDetokenizer, TokenStrings
from peagle.model.target import TargetModel

TEXTS = [
    "naïve café — 日本語のテキスト 🎉🚀 and ✓ done.",
    "Ünïcödé ßtraße: 你好，世界！ 🙂🙃 مرحبا Привет",
    "def f(x):\n    return x ** 2  # ½ π ≈ 3.14159 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Feed ids in chunks of the given sizes, as the engine commits them; the pieces of text each call returns."""
    detok, pieces, done = IncrementalDetokenizer(tokenizer), [], 0
    for size in chunks:
        done = min(len(ids), done + size)
        pieces.append(detok.step(ids[:done], final=done == len(ids)))
        if done == len(ids):
            break
    return pieces


def random_chunks(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 4) for _ in range(n)]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_whole_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # the test is only worth something if characters really are split across tokens
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    rng = random.Random(0)
    for chunks in ([1] * len(ids), random_chunks(rng, len(ids)), random_chunks(rng, len(ids))):
        pieces = stream(tokenizer, ids, chunks)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
        assert not any(REPLACEMENT in p for p in pieces)  # no half character is ever sent


def test_random_tokens_and_special_tokens_equal_whole_decode(tokenizer):
    """Arbitrary id sequences (byte tokens that never form characters, special tokens) give the whole decode too,
    including the U+FFFD a dangling byte decodes to once the output ends."""
    rng = random.Random(1)
    byte_ids = [i for i in range(len(tokenizer)) if REPLACEMENT in tokenizer.decode([i])][:400]
    for trial in range(30):
        ids = [rng.choice(byte_ids) if rng.random() < 0.4 else rng.randrange(len(tokenizer)) for _ in range(40)]
        ids += [tokenizer.eos_token_id, *ids[:3]] if trial % 3 == 0 else []
        pieces = stream(tokenizer, ids, random_chunks(rng, len(ids)))
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_token_strings_give_each_tokens_bytes(tokenizer):
    ids = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    strings = TokenStrings(tokenizer)
    assert bytes(b for i in ids for b in strings(i)[1]).decode() == TEXTS[0]
    assert strings(ids[0])[0] == tokenizer.decode([ids[0]])


@pytest.fixture(scope="module")
def engine(tiny_chat_llama, tokenizer):
    target = TargetModel.from_pretrained(tiny_chat_llama, dtype=torch.float32)
    return LLMEngine(target, tokenizer, max_num_seqs=2, max_model_len=256)


def run_commits(engine: LLMEngine, ids: list[int], chunks: list[int], stop: list[str]):
    """Commit `ids` in chunks as decode steps would, reporting after each; (reports, request)."""
    req = engine.make_request([5, 6, 7], SamplingParams(max_tokens=200, stop=stop, ignore_eos=True))
    logits = torch.zeros(8, engine.target.config.vocab_size)
    reports, done = [], 0
    for size in chunks:
        engine._commit(req, ids[done:done + size], logits)
        done += size
        reports.append(engine._report(req))
        if req.finished or done >= len(ids):
            break
    return reports, req


@pytest.mark.parametrize("text", TEXTS)
def test_engine_stop_strings_spanning_tokens(engine, tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids)
    rng = random.Random(2)
    for start, length in ((5, 4), (len(whole) // 2, 3), (len(whole) - 6, 5)):
        stop = whole[start:start + length]
        # the stop string starts or ends inside some token: it spans a token boundary
        expected = whole[: whole.find(stop)]
        reports, req = run_commits(engine, ids, random_chunks(rng, len(ids)), [stop, "never-there"])
        deltas = "".join(r.delta_text for r in reports)
        assert reports[-1].finished and reports[-1].finish_reason == "stop"
        assert deltas == reports[-1].text == expected
        assert not any(REPLACEMENT in r.delta_text for r in reports)
        # the kept tokens spell the kept text, and one fewer would not
        assert tokenizer.decode(req.output_ids).startswith(expected)
        assert not tokenizer.decode(req.output_ids[:-1]).startswith(expected)


def test_engine_streams_whole_decode_without_stop(engine, tokenizer):
    ids = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    reports, _ = run_commits(engine, ids, [1] * len(ids), [])
    assert "".join(r.delta_text for r in reports) == TEXTS[1]
