"""The target model against transformers' implementation of the same weights.

Tiny random models of every supported family (llama, mistral, qwen2 with q/k/v bias, qwen3 with q/k norms, llama3
rope scaling) in float32 (tight) and bfloat16 (argmax + tolerance), the embedded SmolLM2 on a real chat prompt, the
per-row KV cache (batched rows of different lengths = rows alone; incremental decoding = one full forward) and the
feature layers at vLLM's ids.
"""
from __future__ import annotations

import json

import pytest
import torch

from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel, default_feature_layer_ids
from tests.conftest import cache_contents, make_tiny_model, needs_native_kernels

FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},  # q/k/v bias
    "qwen3": {},  # per-head q/k RMSNorm
    "llama3-rope": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}},
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    out = {}
    for name, overrides in FAMILIES.items():
        model_type = "llama" if name == "llama3-rope" else name
        # 8 layers so the feature ids (2, 4, 5) are distinct and not the first or last layer.
        out[name] = make_tiny_model(tmp_path_factory.mktemp(name), model_type, seed=len(out), num_hidden_layers=8,
                                    **overrides)
    return out


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_forward(model, tokens):
    with torch.inference_mode():
        out = model(tokens, output_hidden_states=True, use_cache=False)
    return out.logits.float(), out.hidden_states


def ours_forward(model, tokens, max_len=None):
    B, T = tokens.shape
    cache = model.new_cache(B, max_len or T)
    layout = BatchLayout.build(torch.arange(B), torch.arange(T)[None].expand(B, T))
    return model(tokens, layout, cache, num_logits=None)


def random_tokens(vocab, *shape, seed=0):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def assert_argmax_equal(ours, ref, margin=0.0):
    """Argmax equal wherever the reference's top-2 gap exceeds `margin` (bf16 rounding may swap near ties)."""
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > margin
    assert decided.float().mean() >= 0.5, "too many near ties for a meaningful argmax comparison"
    assert torch.equal(ours.argmax(-1)[decided], ref.argmax(-1)[decided])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parity_float32(family_dirs, family):
    path = family_dirs[family]
    ref = hf_model(path, torch.float32)
    ours = TargetModel.from_pretrained(path, dtype=torch.float32)
    tokens = random_tokens(ours.config.vocab_size, 2, 24, seed=1)
    ref_logits, hidden = hf_forward(ref, tokens)
    out = ours_forward(ours, tokens)
    torch.testing.assert_close(out.logits, ref_logits, atol=2e-4, rtol=1e-4)
    assert torch.equal(out.logits.argmax(-1), ref_logits.argmax(-1))
    ids = default_feature_layer_ids(ours.config.num_layers)
    assert ids == ours.feature_layer_ids == (2, 4, 5)
    expected = torch.cat([hidden[i] for i in ids], dim=-1)
    assert out.features.shape == (2, 24, 3 * ours.config.hidden_size)
    torch.testing.assert_close(out.features, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_parity_bfloat16(family_dirs, family):
    path = family_dirs[family]
    ref = hf_model(path, torch.bfloat16)
    ours = TargetModel.from_pretrained(path, dtype=torch.bfloat16)
    tokens = random_tokens(ours.config.vocab_size, 1, 32, seed=2)
    ref_logits, hidden = hf_forward(ref, tokens)
    out = ours_forward(ours, tokens)
    assert out.features.dtype == torch.bfloat16
    scale = ref_logits.abs().max()
    assert (out.logits - ref_logits).abs().max() <= 0.05 * scale
    assert_argmax_equal(out.logits, ref_logits, margin=0.01 * scale)


def test_feature_ids_repeat_for_tiny_targets(tmp_path):
    # 6 layers: ids (2, 3, 3); the repeated id repeats its layer, so g stays 3 * Ht wide as vLLM builds it.
    path = make_tiny_model(tmp_path, "llama", num_hidden_layers=6)
    ours = TargetModel.from_pretrained(path, dtype=torch.float32)
    tokens = random_tokens(ours.config.vocab_size, 1, 8)
    _, hidden = hf_forward(hf_model(path, torch.float32), tokens)
    out = ours_forward(ours, tokens)
    assert ours.feature_layer_ids == (2, 3, 3)
    torch.testing.assert_close(out.features, torch.cat([hidden[2], hidden[3], hidden[3]], -1), atol=1e-5, rtol=1e-5)


def test_num_logits_selects_last_rows(family_dirs):
    ours = TargetModel.from_pretrained(family_dirs["llama"], dtype=torch.float32)
    tokens = random_tokens(ours.config.vocab_size, 2, 10, seed=3)
    full = ours_forward(ours, tokens).logits
    for n in (1, 3):
        cache = ours.new_cache(2, 10)
        out = ours(tokens, BatchLayout.build(torch.arange(2), torch.arange(10)[None].expand(2, 10)), cache, num_logits=n)
        assert out.logits.shape == (2, n, ours.config.vocab_size) and out.logits.dtype == torch.float32
        torch.testing.assert_close(out.logits, full[:, -n:], atol=1e-5, rtol=1e-5)


def test_batched_rows_equal_rows_alone(family_dirs):
    """Rows of different lengths in non-contiguous slots, padded, then a verify-like step of different widths."""
    ours = TargetModel.from_pretrained(family_dirs["qwen3"], dtype=torch.float32)
    V = ours.config.vocab_size
    lengths, slots = [5, 11, 8], torch.tensor([2, 0, 3])
    prompts = [random_tokens(V, n, seed=10 + i) for i, n in enumerate(lengths)]
    steps = [random_tokens(V, k, seed=20 + i) for i, k in enumerate([1, 4, 2])]

    # Alone: each row in its own one-slot cache, prefill then the step.
    alone = []
    for p, s in zip(prompts, steps):
        cache = ours.new_cache(1, 32)
        a = ours(p[None], BatchLayout.build(torch.tensor([0]), torch.arange(len(p))[None]), cache, num_logits=None)
        b = ours(s[None], BatchLayout.build(torch.tensor([0]), (len(p) + torch.arange(len(s)))[None]), cache,
                 num_logits=None)
        alone.append((a, b))

    # Batched: padded to the longest row; pad queries continue the row's positions (their cache writes are stale).
    cache = ours.new_cache(4, 32)

    def batch(seqs, starts):
        T = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
        positions = torch.tensor(starts)[:, None] + torch.arange(T)[None]
        return ours(tokens, BatchLayout.build(slots, positions), cache, num_logits=None)

    pre = batch(prompts, [0, 0, 0])
    step = batch(steps, lengths)
    for i, (a, b) in enumerate(alone):
        n, k = lengths[i], len(steps[i])
        torch.testing.assert_close(pre.logits[i, :n], a.logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pre.features[i, :n], a.features[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step.logits[i, :k], b.logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step.features[i, :k], b.features[0], atol=1e-5, rtol=1e-5)


def test_incremental_decoding_equals_full_forward(family_dirs):
    ours = TargetModel.from_pretrained(family_dirs["mistral"], dtype=torch.float32)
    tokens = random_tokens(ours.config.vocab_size, 1, 20, seed=4)
    full = ours_forward(ours, tokens, max_len=32)
    cache = ours.new_cache(1, 32)
    slot = torch.tensor([0])
    pieces = [ours(tokens[:, :12], BatchLayout.build(slot, torch.arange(12)[None]), cache, num_logits=None)]
    # A rejected speculative step writes stale entries past the accepted length; the next step overwrites them.
    ours(random_tokens(ours.config.vocab_size, 1, 5, seed=5), BatchLayout.build(slot, (12 + torch.arange(5))[None]),
         cache)
    for t in range(12, 20):
        pieces.append(ours(tokens[:, t:t + 1], BatchLayout.build(slot, torch.tensor([[t]])), cache, num_logits=None))
    logits = torch.cat([p.logits for p in pieces], dim=1)
    features = torch.cat([p.features for p in pieces], dim=1)
    torch.testing.assert_close(logits, full.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(features, full.features, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}))
    with pytest.raises(ValueError) as e:
        TargetModel.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "gpt2" in msg
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert name in msg


def test_smollm2_chat_prompt_matches_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? Answer briefly."}],
                                  add_generation_prompt=True)
    ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    tokens = torch.tensor([ids])
    # The reference is transformers in fp32: its own bf16 forward is as far from it as ours (1.27 and 1.29 logits
    # on an AVX2-only Zen 3), and the two bf16 forwards differ from each other by up to twice that.
    ref_logits, hidden = hf_forward(hf_model(smollm2_dir, torch.float32), tokens)
    ours = TargetModel.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    out = ours_forward(ours, tokens)
    assert ours.feature_layer_ids == (2, 15, 27)
    assert torch.equal(out.logits[0, -1].argmax(), ref_logits[0, -1].argmax())
    scale = ref_logits.abs().max()
    assert (out.logits - ref_logits).abs().max() <= 0.05 * scale
    assert_argmax_equal(out.logits, ref_logits, margin=0.01 * scale)
    expected = torch.cat([hidden[i] for i in ours.feature_layer_ids], dim=-1).float()
    rel = (out.features.float() - expected).norm() / expected.norm()
    assert rel < 0.02


@pytest.fixture(scope="module")
def wide_head_dir(tmp_path_factory):
    """Tiny llama with head_dim 64 (the width peagle's CPU attention kernel handles, like SmolLM2)."""
    return make_tiny_model(tmp_path_factory.mktemp("wide"), "llama", seed=7, hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=8)


def test_bfloat16_decoding_matches_transformers(wide_head_dir):
    """One-row decode steps over the cache (the path speculative decoding's plain baseline takes) in bf16."""
    ref = hf_model(wide_head_dir, torch.bfloat16)
    ours = TargetModel.from_pretrained(wide_head_dir, dtype=torch.bfloat16)
    tokens = random_tokens(ours.config.vocab_size, 1, 26, seed=8)
    ref_logits, _ = hf_forward(ref, tokens)
    cache, slot = ours.new_cache(1, 32), torch.tensor([0])
    pieces = [ours(tokens[:, :20], BatchLayout.build(slot, torch.arange(20)[None]), cache, num_logits=None).logits]
    for t in range(20, 26):
        pieces.append(ours(tokens[:, t:t + 1], BatchLayout.build(slot, torch.tensor([[t]])), cache).logits)
    logits = torch.cat(pieces, dim=1)
    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= 0.05 * scale
    assert_argmax_equal(logits, ref_logits, margin=0.01 * scale)


@needs_native_kernels
def test_rows_do_not_depend_on_their_batch(wide_head_dir):
    """Batch invariance, bit for bit: a token decoded alone, verified inside a window of K+1 rows, or batched with
    another request gets the same logits and features. This is what keeps speculative decoding token-for-token
    equal to plain decoding (docs/design.md, "Decoding step"). PyTorch's own CPU kernels (F.linear, flash
    attention) round differently for different row counts, so this holds for bf16 where peagle's kernels run."""
    ours = TargetModel.from_pretrained(wide_head_dir, dtype=torch.bfloat16)
    V = ours.config.vocab_size
    prompt, new, other = random_tokens(V, 1, 30, seed=9), random_tokens(V, 1, 8, seed=10), random_tokens(V, 1, 45, seed=11)

    def prefilled(slots=1):
        cache = ours.new_cache(slots, 64)
        ours(prompt, BatchLayout.build(torch.tensor([0]), torch.arange(30)[None]), cache)
        return cache

    cache = prefilled()  # one row at a time
    alone = [ours(new[:, t:t + 1], BatchLayout.build(torch.tensor([0]), torch.tensor([[30 + t]])), cache)
             for t in range(8)]
    alone_logits = torch.cat([o.logits for o in alone], 1)
    alone_feats = torch.cat([o.features for o in alone], 1)

    cache = prefilled()  # one verify window of 8 rows
    window = ours(new, BatchLayout.build(torch.tensor([0]), (30 + torch.arange(8))[None]), cache, num_logits=None)
    assert torch.equal(window.logits, alone_logits) and torch.equal(window.features, alone_feats)

    cache = prefilled(slots=3)  # batched with a longer request in another slot, padded
    ours(other, BatchLayout.build(torch.tensor([2]), torch.arange(45)[None]), cache)
    tokens = torch.cat([new, random_tokens(V, 1, 8, seed=12)])
    positions = torch.stack([30 + torch.arange(8), 45 + torch.arange(8)])
    batched = ours(tokens, BatchLayout.build(torch.tensor([0, 2]), positions), cache, num_logits=None)
    assert torch.equal(batched.logits[:1], alone_logits) and torch.equal(batched.features[:1], alone_feats)


@needs_native_kernels
def test_native_layers_equal_the_modules_bit_for_bit(wide_head_dir):
    """The one-call native decoder layer runs the same kernels in the same order as DecoderLayer: identical logits,
    features and cache, for a prefill and a decode step of two requests in swapped slots."""
    ours = TargetModel.from_pretrained(wide_head_dir, dtype=torch.bfloat16)
    assert ours.native_layers is not None
    V = ours.config.vocab_size
    tokens, slots = random_tokens(V, 2, 20, seed=13), torch.tensor([1, 0])
    runs = []
    for native in (ours.native_layers, None):
        ours.native_layers = native
        cache = ours.new_cache(2, 32)
        first = ours(tokens, BatchLayout.build(slots, torch.arange(20)[None].expand(2, 20)), cache, num_logits=None)
        step = ours(tokens[:, :3], BatchLayout.build(slots, 20 + torch.arange(3)[None].expand(2, 3)), cache,
                    num_logits=None)
        runs.append((first, step, cache))
    (a1, a2, ca), (b1, b2, cb) = runs
    assert torch.equal(a1.logits, b1.logits) and torch.equal(a1.features, b1.features)
    assert torch.equal(a2.logits, b2.logits) and torch.equal(a2.features, b2.features)
    assert all(torch.equal(x, y) for x, y in zip(cache_contents(ca), cache_contents(cb)))
