"""peagle's native CPU kernels (peagle/model/kernels.py): numerics against PyTorch and batch invariance.

Skipped where the machine cannot run them (no AVX-512 BF16 / AMX, or no C compiler); the model then uses PyTorch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peagle.model import kernels

needs_lib = pytest.mark.skipif(not kernels.available(), reason="peagle's CPU kernels are unavailable here")
needs_amx = pytest.mark.skipif(not kernels.amx_available(), reason="AMX is unavailable here")


def bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("N, K", [(960, 576), (576, 1536), (49152, 64), (7, 40), (33, 100), (130, 96)])
def test_packed_linear_matches_pytorch_and_is_batch_invariant(N, K):
    w, x = bf16(N, K, seed=1), bf16(70, K, seed=2)
    packed = kernels.PackedWeight.pack(w)
    with torch.inference_mode():
        full = kernels.packed_linear(x, packed)
        ref = F.linear(x.float(), w.float())
        assert full.dtype == torch.bfloat16 and full.shape == (70, N)
        # bf16 output of an fp32-accumulated product: within bf16 rounding of the exact result
        assert ((full.float() - ref).abs() <= 1e-2 * ref.abs() + 1e-2 * ref.abs().max() / 64).all()
        for M in (1, 2, 3, 8, 16, 17, 33):
            assert torch.equal(kernels.packed_linear(x[:M], packed), full[:M]), M
        # leading dims and a strided input
        assert torch.equal(kernels.packed_linear(x[:12].view(3, 4, K), packed).view(12, N), full[:12])
        wide = torch.cat([x, x], dim=1)[:, :K]
        assert torch.equal(kernels.packed_linear(wide, packed), full)


@needs_amx
def test_packed_path_is_skipped_when_it_does_not_apply():
    w = bf16(64, 32)
    packed = kernels.PackedWeight.pack(w)
    assert kernels.packed_linear(bf16(2, 32).float(), packed) is None  # fp32 input
    x = bf16(2, 32).requires_grad_()
    assert kernels.packed_linear(x, packed) is None  # needs gradients
    assert kernels.PackedWeight.pack(w.float()) is None


@needs_lib
def test_rms_norm_equals_the_reference_rounding():
    for i in range(20):
        x, w = bf16(3, 5, 576, seed=i, scale=1 + i), bf16(576, seed=100 + i)
        ref = w * torch.rms_norm(x.float(), (576,), None, 1e-5).to(torch.bfloat16)
        with torch.inference_mode():
            out = kernels.rms_norm_bf16(x, w, 1e-5)
        assert (out != ref).float().mean() < 1e-3  # summation order may flip a rare last bit
        assert (out.float() - ref.float()).abs().max() <= 0.01 * ref.float().abs().max()


@needs_lib
def test_rope_equals_the_reference_rounding():
    from peagle.model.layers import _rope_heads_last

    x, cos, sin = bf16(2, 5, 12, 64, seed=3), bf16(2, 5, 64, seed=4), bf16(2, 5, 64, seed=5)
    ref = _rope_heads_last(x[:, :, :9], cos, sin)
    y = x.clone()
    with torch.inference_mode():
        assert kernels.rope_bf16_(y, cos, sin, heads=9)
    assert torch.equal(y[:, :, :9], ref) and torch.equal(y[:, :, 9:], x[:, :, 9:])


@needs_lib
def test_attention_matches_sdpa_and_is_batch_invariant():
    nh, nkv, D, max_len = 9, 3, 64, 256
    kc, vc = bf16(3, nkv, max_len, D, seed=6), bf16(3, nkv, max_len, D, seed=7)
    q = bf16(2, 8, nh, D, seed=8)
    slots = torch.tensor([2, 0])
    positions = torch.stack([200 + torch.arange(8), 17 + torch.arange(8)])
    with torch.inference_mode():
        out = kernels.attention_bf16(q, kc, vc, slots, positions)
        L = int(positions.max()) + 1
        mask = (torch.arange(L)[None, None, :] <= positions[:, :, None])[:, None]
        ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), kc[slots, :, :L].float(),
                                             vc[slots, :, :L].float(), attn_mask=mask, enable_gqa=True)
        assert (out.float() - ref.transpose(1, 2)).abs().max() < 0.02
        for b in range(2):
            for t in range(8):
                one = kernels.attention_bf16(q[b:b + 1, t:t + 1], kc, vc, slots[b:b + 1], positions[b:b + 1, t:t + 1])
                assert torch.equal(one[0, 0], out[b, t])


@needs_lib
@pytest.mark.parametrize("D", [16, 48, 128])
def test_attention_head_sizes(D):
    nh, nkv, max_len = 4, 2, 64
    kc, vc = bf16(1, nkv, max_len, D, seed=9), bf16(1, nkv, max_len, D, seed=10)
    q = bf16(1, 5, nh, D, seed=11)
    positions = (20 + torch.arange(5))[None]
    with torch.inference_mode():
        out = kernels.attention_bf16(q, kc, vc, torch.tensor([0]), positions)
    mask = (torch.arange(25)[None, None, :] <= positions[:, :, None])[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), kc[:, :, :25].float(), vc[:, :, :25].float(),
                                         attn_mask=mask, enable_gqa=True).transpose(1, 2)
    assert (out.float() - ref).abs().max() < 0.02
