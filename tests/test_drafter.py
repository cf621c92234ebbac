"""The drafter against a reference written directly from docs/design.md, "Drafter".

`reference_hidden` below re-implements the head from the design's equations with plain tensor ops (no peagle
layers): fc, the fusion layer (input_layernorm(embed) | hidden_norm(h) -> attention of width 2H, residual h, or
hidden_norm(h) for a head with norm_before_residual), plain Llama layers, GQA attention with RoPE under a plain causal mask over one uncached sequence. The inputs for P-EAGLE
are built by hand from the design's table (real rows: token x_{t+1}, feature g_t, position t; slots: mask token,
mask_hidden, positions n, n+1, ...).
"""
from __future__ import annotations

import pytest
import torch

from peagle.model.drafter import Drafter, DrafterConfig
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetConfig
from tests.conftest import cache_contents, needs_native_kernels

MASK_ID = 3
V, VD, H = 512, 200, 64


@pytest.fixture(scope="module")
def target_config() -> TargetConfig:
    return TargetConfig.from_hf(dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=128,
                                     num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024))


def make_head(target: TargetConfig, parallel: bool = True, num_layers: int = 2, seed: int = 0,
              norm_before_residual: bool = False) -> Drafter:
    """A random float32 head with a pruned draft vocab (random sorted subset of the target vocab)."""
    config = DrafterConfig.for_target(target, num_layers=num_layers, draft_vocab_size=VD,
                                      mask_token_id=MASK_ID if parallel else None,
                                      norm_before_residual=norm_before_residual)
    g = torch.Generator().manual_seed(seed)
    head = Drafter(config)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name or name == "mask_hidden" else 0.1))
        used = torch.randperm(V, generator=g)[:VD].sort().values
        head.d2t.copy_(used - torch.arange(VD))
        head.t2d.zero_()
        head.t2d[used] = True
    return head.eval().requires_grad_(False)


# -- the reference, from docs/design.md, "Drafter" ---------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):  # x [heads, T, D]
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float) / D)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


def _attention(layer, x, positions, c: DrafterConfig):
    a = layer.self_attn
    T, nh, nkv, D = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    q = (x @ a.q_proj.weight.T).view(T, nh, D).transpose(0, 1)
    k = (x @ a.k_proj.weight.T).view(T, nkv, D).transpose(0, 1)
    v = (x @ a.v_proj.weight.T).view(T, nkv, D).transpose(0, 1)
    theta = c.rope_parameters["rope_theta"]
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = q @ k.transpose(1, 2) / D ** 0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (p @ v).transpose(0, 1).reshape(T, nh * D) @ a.o_proj.weight.T


def _mlp(layer, x):
    m = layer.mlp
    return (torch.nn.functional.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def reference_hidden(head: Drafter, tokens, h_in, positions):
    """Pre-norm output of one sequence: tokens [T], h_in [T, H] (already through fc), positions [T]."""
    c, eps = head.config, head.config.rms_norm_eps
    L0 = head.midlayer
    e = _rms(head.embed_tokens.weight[tokens], L0.input_layernorm.weight, eps)
    hn = _rms(h_in, L0.hidden_norm.weight, eps)
    x = (hn if c.norm_before_residual else h_in) + _attention(L0, torch.cat([e, hn], -1), positions, c)
    x = x + _mlp(L0, _rms(x, L0.post_attention_layernorm.weight, eps))
    for layer in head.layers.values():
        x = x + _attention(layer, _rms(x, layer.input_layernorm.weight, eps), positions, c)
        x = x + _mlp(layer, _rms(x, layer.post_attention_layernorm.weight, eps))
    return x


def reference_logits(head: Drafter, hidden):
    return _rms(hidden, head.norm.weight, head.config.rms_norm_eps) @ head.lm_head.weight.T


def reference_parallel(head: Drafter, next_tokens, feats, k):
    """The design's table for a request with n real rows (row t: token x_{t+1}, feature g_t, position t) + K-1 slots."""
    n = len(next_tokens)
    tokens = torch.cat([next_tokens, torch.full((k - 1,), MASK_ID)])
    g = torch.cat([feats, head.mask_hidden.reshape(1, -1).expand(k - 1, -1)])
    hidden = reference_hidden(head, tokens, g @ head.fc.weight.T, torch.arange(n + k - 1))
    logits = reference_logits(head, hidden[n - 1:])
    draft = logits.argmax(-1)
    return draft + head.d2t[draft], logits


def context(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(20, V, (n,), generator=g), torch.randn(n, 3 * H, generator=g)


# -- P-EAGLE ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,norm_before_residual", [(1, False), (4, False), (7, False), (4, True)])
def test_parallel_equals_reference_then_continues_over_stale_slots(target_config, k, norm_before_residual):
    head = make_head(target_config, norm_before_residual=norm_before_residual)
    toks, feats = context(13, seed=1)
    cache = head.new_cache(2, 64)
    slot = torch.tensor([1])
    # Step 1: the prompt's rows.
    drafts = head.draft_parallel(toks[None, :9], feats[None, :9], torch.tensor([9]), torch.tensor([0]), slot, cache, k)
    ref, ref_logits = reference_parallel(head, toks[:9], feats[:9], k)
    assert drafts.shape == (1, k) and torch.equal(drafts[0], ref)
    # The same rows through forward + logits are numerically the reference.
    positions = torch.arange(9 + k - 1)[None]
    tokens = torch.cat([toks[:9], torch.full((k - 1,), MASK_ID)])[None]
    g = torch.cat([feats[:9], head.mask_hidden.reshape(1, -1).expand(k - 1, -1)])[None]
    hidden = head(tokens, g, BatchLayout.build(torch.tensor([0]), positions), head.new_cache(1, 64))
    torch.testing.assert_close(head.logits(hidden[0, 8:]), ref_logits, atol=1e-4, rtol=1e-4)
    # Step 2: 4 more real rows (accepted tokens) at positions 9..12 overwrite step 1's stale mask slots.
    drafts = head.draft_parallel(toks[None, 9:], feats[None, 9:], torch.tensor([4]), torch.tensor([9]), slot, cache, k)
    ref, _ = reference_parallel(head, toks, feats, k)
    assert torch.equal(drafts[0], ref)


def test_parallel_batched_rows_equal_rows_alone(target_config):
    head = make_head(target_config, seed=2)
    k = 5
    (ta, fa), (tb, fb) = context(7, seed=3), context(11, seed=4)
    # Two requests in slots 2 and 0, left-aligned and padded: request a has 3 unseen rows, b has 1.
    cache = head.new_cache(3, 64)
    slots = torch.tensor([2, 0])
    head.draft_parallel(torch.stack([ta[:4], tb[:4]]), torch.stack([fa[:4], fb[:4]]), torch.tensor([4, 4]),
                        torch.tensor([0, 0]), slots, cache, k)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    features = torch.zeros(2, 3, 3 * H)
    tokens[0], features[0] = ta[4:7], fa[4:7]
    tokens[1, :1], features[1, :1] = tb[4:5], fb[4:5]
    drafts = head.draft_parallel(tokens, features, torch.tensor([3, 1]), torch.tensor([4, 4]), slots, cache, k)
    assert torch.equal(drafts[0], reference_parallel(head, ta[:7], fa[:7], k)[0])
    assert torch.equal(drafts[1], reference_parallel(head, tb[:5], fb[:5], k)[0])


def test_mask_slots_never_see_later_slots(target_config):
    head = make_head(target_config, seed=5)
    toks, feats = context(6, seed=6)
    k = 6
    tokens = torch.cat([toks, torch.full((k - 1,), MASK_ID)])[None]
    g = torch.cat([feats, head.mask_hidden.reshape(1, -1).expand(k - 1, -1)])[None]
    positions = torch.arange(6 + k - 1)[None]

    def run(tokens, g):
        return head(tokens, g, BatchLayout.build(torch.tensor([0]), positions), head.new_cache(1, 32))

    base = run(tokens, g)
    for j in range(6, 6 + k - 1):  # perturb slot j: token and feature
        t2, g2 = tokens.clone(), g.clone()
        t2[0, j] = 42
        g2[0, j] = torch.randn(3 * H)
        out = run(t2, g2)
        assert torch.equal(out[0, :j], base[0, :j]), f"rows before slot {j} changed"
        assert not torch.allclose(out[0, j], base[0, j])


def test_dense_layout_equals_reference(target_config):
    """Training runs Drafter.forward with BatchLayout.dense and its own mask; a causal one is the reference."""
    head = make_head(target_config, seed=7)
    toks, feats = context(10, seed=8)
    T = 10
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
    hidden = head(toks[None], feats[None], BatchLayout.dense(torch.arange(T)[None], mask), None)
    ref = reference_hidden(head, toks, feats @ head.fc.weight.T, torch.arange(T))
    torch.testing.assert_close(hidden[0], ref, atol=1e-4, rtol=1e-4)


def test_head_without_mask_hidden_refuses_parallel(target_config):
    head = make_head(target_config, parallel=False)
    assert head.mask_hidden is None and not head.config.parallel_capable
    toks, feats = context(4, seed=9)
    with pytest.raises(ValueError, match="mask_hidden"):
        head.draft_parallel(toks[None], feats[None], torch.tensor([4]), torch.tensor([0]), torch.tensor([0]),
                            head.new_cache(1, 16), 3)


# -- EAGLE-3 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel_head,norm_before_residual", [(False, False), (True, False), (False, True)])
def test_chain_equals_k_single_steps(target_config, parallel_head, norm_before_residual):
    head = make_head(target_config, parallel=parallel_head, seed=10, norm_before_residual=norm_before_residual)
    toks, feats = context(8, seed=11)
    k = 4
    cache = head.new_cache(1, 32)
    drafts = head.draft_chain(toks[None], feats[None], torch.tensor([8]), torch.tensor([0]), torch.tensor([0]),
                              cache, k)
    # K single steps, each one uncached dense pass over everything so far: the fed-back row carries the previous
    # draft (a target id) and the previous pre-norm output, at the next position.
    tokens, h_in = toks.clone(), feats @ head.fc.weight.T
    expected = []
    for _ in range(k):
        hidden = reference_hidden(head, tokens, h_in, torch.arange(len(tokens)))
        d = reference_logits(head, hidden[-1]).argmax(-1)
        d = d + head.d2t[d]
        expected.append(int(d))
        tokens = torch.cat([tokens, d[None]])
        h_in = torch.cat([h_in, hidden[-1:]])
    assert drafts.tolist() == [expected]


def test_packed_head_drafts_like_the_plain_one(target_config):
    """Drafter.pack_() (inference on CPUs where peagle's kernels run) changes speed, not results beyond bf16
    rounding."""
    import copy

    from peagle.model import kernels

    head = make_head(target_config, seed=12).to(torch.bfloat16)
    packed = copy.deepcopy(head).pack_()
    if kernels.available():
        assert packed.lm_head_packed is not None and packed.midlayer.self_attn.qkv.packed is not None
    toks, feats = context(9, seed=13)
    feats = feats.to(torch.bfloat16)
    positions = torch.arange(9)[None]
    with torch.inference_mode():
        a = head(toks[None], feats[None], BatchLayout.build(torch.tensor([0]), positions), head.new_cache(1, 32))
        b = packed(toks[None], feats[None], BatchLayout.build(torch.tensor([0]), positions), packed.new_cache(1, 32))
        la, lb = head.logits(a), packed.logits(b)
    assert (la - lb).abs().max() <= 0.02 * la.abs().max()
    top2 = la.topk(2, -1).values
    decided = top2[..., 0] - top2[..., 1] > 0.01 * la.abs().max()
    assert torch.equal(la.argmax(-1)[decided], lb.argmax(-1)[decided])


@needs_native_kernels
@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_native_layers_give_the_modules_bits(target_config, quantization):
    """A packed head runs each layer in one native call (the fusion layer from its [embedding, feature] input):
    the same hidden states, drafts and cache entries as its own modules, bit for bit, for a batch with padding."""
    import copy

    head = make_head(target_config, seed=14).to(torch.bfloat16).pack_(quantization)
    assert head.native_layers is not None and len(head.native_layers) == 2
    modules = copy.copy(head)
    modules.native_layers = None
    g = torch.Generator().manual_seed(15)
    tokens = torch.randint(4, V, (2, 3), generator=g)
    feats = torch.randn(2, 3, 3 * H, generator=g).to(torch.bfloat16)
    num_real, start, slots = torch.tensor([3, 2]), torch.tensor([7, 20]), torch.tensor([1, 0])
    out = {}
    for name, h in (("native", head), ("modules", modules)):
        cache = h.new_cache(2, 64)
        with torch.inference_mode():
            hidden = h(tokens, feats, BatchLayout.build(slots, start[:, None] + torch.arange(3)), cache)
            drafts = h.draft_parallel(tokens, feats, num_real, start + 3, slots, cache, 4)
        out[name] = (hidden, drafts, cache)
    (ha, da, ca), (hb, db, cb) = out["native"], out["modules"]
    assert torch.equal(ha, hb) and torch.equal(da, db)
    assert all(torch.equal(x, y) for x, y in zip(cache_contents(ca), cache_contents(cb)))
