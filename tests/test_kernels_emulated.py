"""kernels.c's AVX-512 sections run on CPUs without AVX-512: compiled against SIMDe's portable definitions of the
intrinsics (kernels.emulated_library()), the VNNI block-quantized kernels must give the real AVX2 library's bits for
every block format, shape and row count (the promise of tests/test_quant.py's "every path gives the same bits", which
skips on CPUs without VNNI), and the AVX-512 BF16 matrix and attention kernels must keep their own promises (the
checks of tests/test_kernels.py, run unchanged on the emulated library), on the real Gemma 3 file's activations too.

What this proves is the sections' logic under the instructions' semantics as SIMDe and the shims in kernels.c define
them (Intel's manual); not the compiler's code for real AVX-512, nor anything about speed."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from peagle.model import kernels, quant
from tests import test_kernels
from tests.conftest import needs_native_kernels, paged
from tests.test_kernels import bf16
from tests.test_kquants import _FP16_AT, gemma_file, first_tensors_of_each_type, kernel_activations, random_blocks

pytestmark = needs_native_kernels
FP16_AT = {**_FP16_AT, "q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,)}  # where each block's fp16 d (m, dmin) sit
ROW_COUNTS = [*range(1, 9), 13, 24]  # every VNNI register block (1..8 rows) and tiles with remainders


@pytest.fixture(scope="module")
def emulated():
    lib = kernels.emulated_library()
    if lib is None:
        message = ("SIMDe's headers are missing (apt-get install libsimde-dev; `bash scripts/setup.sh --test` "
                   "installs them): the AVX-512 sections cannot be emulated here")
        if kernels.cpu_has("avx512-vnni") and kernels.cpu_has("avx512-bf16"):
            pytest.skip(message + ", and this CPU checks them natively (tests/test_quant.py, tests/test_kernels.py)")
        pytest.fail(message + ", and this CPU lacks them, so nothing else checks them")
    return lib


def qgemm(lib, path: str, qw: quant.QuantWeight, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    """x [M, K] @ W^T by `lib`'s kernel for quantized-weight path `path` (the qpanels are the same on every path)."""
    M, K = x.shape
    y = torch.empty(M, qw.out_features, dtype=torch.bfloat16)
    fn = getattr(lib, kernels.qgemm_symbol(path, qw.format))
    assert fn(x.data_ptr(), K, qw.data_ptr, y.data_ptr(), qw.out_features, M, qw.out_features, K, threads) == 0
    return y


def blocks_of(fmt: str, N: int, K: int, seed: int) -> torch.Tensor:
    """Random bytes (every code, scale and fifth-bit pattern) with sane fp16 scales; for the formats --quantization
    makes, the real quantizer's blocks of a matrix whose rows have different scales."""
    if fmt in quant.QUANTIZATIONS:
        g = torch.Generator().manual_seed(seed)
        return quant.quantize_blocks(torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g), fmt)
    return torch.from_numpy(random_blocks(fmt, N, K, seed=seed))


def assert_vnni_gives_avx2_bits(emulated, qw: quant.QuantWeight, x: torch.Tensor) -> None:
    """Each row of every M-row VNNI call equals the AVX2 library's one-row bits (batch invariance and one answer
    for every path at once), at the start of x and at its end (other positions in the row tiles)."""
    alone = torch.cat([qgemm(kernels.library(), "avx2", qw, x[r:r + 1]) for r in range(len(x))])
    assert torch.equal(qgemm(kernels.library(), "avx2", qw, x), alone)
    for M in ROW_COUNTS:
        if M <= len(x):
            assert torch.equal(qgemm(emulated, "avx512-vnni", qw, x[:M]), alone[:M]), f"{qw.format}: {M} rows"
            assert torch.equal(qgemm(emulated, "avx512-vnni", qw, x[-M:]), alone[-M:]), f"{qw.format}: last {M}"


# (N, K): N not a multiple of 8 and an odd number of 8-column groups (the VNNI kernels' lone last group of a
# 16-column pair), one group alone; K-quants with K not a multiple of 512 (an odd number of super-blocks).
SHAPES_32 = [(197, 576), (40, 96), (8, 32)]
SHAPES_256 = [(197, 768), (203, 256), (8, 1280)]


@pytest.mark.parametrize("fmt", kernels.QUANT_FORMATS)
def test_vnni_gives_avx2_bits_for_every_shape_and_row_count(emulated, fmt, one_thread):
    shapes = SHAPES_256 if quant.FORMATS[fmt].inputs == 256 else SHAPES_32
    for i, (N, K) in enumerate(shapes):
        qw = quant.QuantWeight.from_blocks(blocks_of(fmt, N, K, seed=i), fmt, N, K, path="avx2")
        x = (torch.randn(24, K, generator=torch.Generator().manual_seed(i)) *
             torch.rand(24, 1, generator=torch.Generator().manual_seed(100 + i)) * 4).bfloat16()
        assert_vnni_gives_avx2_bits(emulated, qw, x)


def test_vnni_threads_split_columns_without_changing_bits(emulated):
    fmt, N, K = "q4_k", 197, 512
    qw = quant.QuantWeight.from_blocks(blocks_of(fmt, N, K, seed=7), fmt, N, K, path="avx2")
    x = bf16(13, K, seed=7)
    assert torch.equal(qgemm(emulated, "avx512-vnni", qw, x, threads=2), qgemm(kernels.library(), "avx2", qw, x))


@pytest.mark.parametrize("fmt", kernels.QUANT_FORMATS)
def test_vnni_sums_of_the_largest_codes_and_scales_are_exact(emulated, fmt, one_thread):
    """Every code, scale and minimum at its largest (Q8_0's codes at -128, Q6_K's int8 scales at -128 and 127) times
    activations of the largest magnitude of both signs, in every row of a register block: AVX2's bits, and within
    bf16 rounding of the exact sums."""
    f = quant.FORMATS[fmt]
    N, K = 24, 512
    blocks = np.full((N, K // f.inputs, f.block_bytes), 0xFF, dtype=np.uint8)
    if fmt == "q8_0":
        blocks[:, :, 2:] = 0x80
    if fmt == "q6_k":
        blocks[:, :, 192:208] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)
    for at in FP16_AT[fmt]:
        blocks[:, :, at:at + 2] = np.array([2 ** -10], dtype=np.float16).view(np.uint8)
    qw = quant.QuantWeight.from_blocks(torch.from_numpy(blocks.reshape(N, -1)), fmt, N, K, path="avx2")
    x = torch.ones(24, K).bfloat16()
    x[1::2] = -1
    assert_vnni_gives_avx2_bits(emulated, qw, x)
    ref = kernel_activations(x, fmt) @ qw.dequantize().double().T
    assert ref.abs().min() > 0
    assert torch.allclose(qgemm(emulated, "avx512-vnni", qw, x).double(), ref, rtol=2 ** -8, atol=0)


def test_vnni_gives_avx2_bits_on_a_real_q4_k_m_file(emulated, one_thread):
    """The first tensor of each block type of the real Gemma 3 270M Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0), its first
    61 rows."""
    found = first_tensors_of_each_type(gemma_file())
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= set(found)
    for kind, (_, _, K, blocks) in found.items():
        qw = quant.QuantWeight.from_blocks(torch.from_numpy(blocks[:61]), kind.lower(), 61, K, path="avx2")
        assert_vnni_gives_avx2_bits(emulated, qw, bf16(13, K, seed=3))


def in_place(emulated, monkeypatch) -> None:
    """This process's kernel paths with the emulated library in the real one's place, its AVX-512 BF16 path
    runnable (the defaults stay the real CPU's)."""
    monkeypatch.setattr(kernels, "_resolved", dataclasses.replace(kernels.kernel_paths(), lib=emulated,
                                                                  matrix_paths=("avx512-bf16", "avx2")))


@pytest.fixture
def emulated_in_place(emulated, monkeypatch):
    """The emulated library in the real one's place, its AVX-512 BF16 path runnable: tests/test_kernels.py's own
    checks of that path (numerics, batch invariance, threads, attention) then run on it, unchanged."""
    in_place(emulated, monkeypatch)


# tests/test_kernels.py's shapes but its 49,152 x 64 (21 s emulated; it adds panels, not arithmetic).
@pytest.mark.parametrize("N, K", [(960, 576), (576, 1536), (7, 40), (33, 101), (130, 96), (1, 2)])
def test_avx512_bf16_matmul_keeps_its_promises(emulated_in_place, N, K):
    """Not AVX2's bits, which this path does not promise: vdpbf16ps adds a pair's odd product first, AVX2 its even
    one (12 of 116,620 outputs of these shapes differ in the last bit)."""
    test_kernels.test_packed_linear_matches_float64_and_is_batch_invariant("avx512-bf16", N, K)


def test_avx512_bf16_attention_keeps_its_promises(emulated_in_place):
    test_kernels.test_packed_linear_thread_count_does_not_change_bits("avx512-bf16")
    test_kernels.test_attention_writes_the_cache_matches_float64_and_is_batch_invariant("avx512-bf16")
    for D in (8, 48, 128, 256):
        test_kernels.test_attention_head_sizes(D, "avx512-bf16")
    test_kernels.test_attention_ignores_stale_cache_entries_past_each_rows_keys("avx512-bf16")
    test_kernels.test_a_tree_row_reads_its_listed_keys_with_a_chain_rows_bits("avx512-bf16")


@pytest.fixture(scope="module")
def gemma3_attention_inputs():
    """The real Gemma 3 270M file's q, k and v [1, 600, heads, 256] at its first global-attention layer, 600 tokens
    of natural text (the module path on the real library records what its attention call receives)."""
    from peagle.bench.datasets import sharegpt_text
    from peagle.model import layers
    from peagle.model.loading import load_tokenizer
    from peagle.model.target import FULL_ATTENTION, TargetModel

    path = gemma_file()
    target = TargetModel.from_pretrained(path)
    target.native_layers = None  # the modules, whose attention goes through layers.attend
    ids = torch.tensor(load_tokenizer(path)(sharegpt_text(4000)).input_ids[:600])
    layer = target.config.layer_types.index(FULL_ATTENTION)
    calls, attend = [], layers.attend

    def recording(q, k, v, *args, **kwargs):
        calls.append((q.clone(), k.clone(), v.clone()))
        return attend(q, k, v, *args, **kwargs)

    layers.attend = recording
    try:
        with torch.inference_mode():
            target(ids[None], layers.BatchLayout.build(torch.tensor([0]), torch.arange(600)[None]),
                   target.new_cache(1, 600), num_logits=1)
    finally:
        layers.attend = attend
    return calls[layer]


def test_avx512_bf16_attention_on_real_gemma3_activations(emulated, gemma3_attention_inputs, monkeypatch):
    """The vdpbf16ps attention on Gemma 3's own queries, keys and values (head size 256, four query heads per
    key/value head, 600 keys): as close to a float64 attention as the AVX2 path (measured 0.0017 against 0.0016,
    relative, both mostly the output's bf16 rounding), so a Gemma 3 forward on an AVX-512 BF16 CPU loses nothing
    to it; where this CPU has AVX-512 BF16, the emulation gives the instructions' own bits."""
    q, k, v = gemma3_attention_inputs
    T, rows = q.shape[1], slice(584, 600)  # the last 16 queries, each over 585-600 keys
    cache_k, cache_v = k[0].transpose(0, 1)[None].contiguous(), v[0].transpose(0, 1)[None].contiguous()
    positions = torch.arange(T)[None, rows]

    def attention(path: str) -> torch.Tensor:
        with torch.inference_mode():
            return kernels.attention_bf16(q[:, rows], k[:, rows], v[:, rows], paged(cache_k, cache_v),
                                          torch.tensor([0]), positions, path=path).double()

    G = q.shape[2] // k.shape[2]
    keys, values = cache_k[0].double().repeat_interleave(G, 0), cache_v[0].double().repeat_interleave(G, 0)
    scores = q[0, rows].double().transpose(0, 1) @ keys.transpose(1, 2) * q.shape[-1] ** -0.5  # [heads, 16, T]
    scores = scores.masked_fill(torch.arange(T)[None, :] > positions[0][:, None], float("-inf"))
    exact = (torch.softmax(scores, -1) @ values).transpose(0, 1)[None]
    error = {}
    native = {"avx2": attention("avx2")}
    if kernels.cpu_has("avx512-bf16"):
        native["avx512-bf16"] = attention("avx512-bf16")
    in_place(emulated, monkeypatch)
    emulated_out = attention("avx512-bf16")
    for name, out in {**native, "emulated avx512-bf16": emulated_out}.items():
        error[name] = ((out - exact).norm() / exact.norm()).item()
    assert error["emulated avx512-bf16"] < 1.25 * error["avx2"], error
    assert error["avx2"] < 2 ** -8, error  # the bf16 output's own rounding is up to 2^-9 per element
    if "avx512-bf16" in native:
        assert torch.equal(emulated_out, native["avx512-bf16"])
