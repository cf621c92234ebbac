"""Block-quantized weights (GGUF Q4_0, Q4_1, Q8_0): the kernels against a float64 reference, batch invariance,
GGUF files read back bit for bit, clear errors for what is not supported, and greedy speculation on the quantized
embedded model equal to its plain greedy decoding (docs/performance.md, "Quantized weights")."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model import kernels, quant
from peagle.model.checkpoint import load_head
from peagle.model.gguf_model import read_tensors
from peagle.model.heads import DEFAULT_HEADS, resolve_head
from peagle.model.loading import config_dir, embedded_gguf_path
from peagle.model.target import TargetModel
from tests.conftest import needs_native_kernels
from tests.test_lossless_smollm2 import PROMPTS, MAX_TOKENS, assert_case_lossless

# Quantized weights run only on peagle's kernels: AVX2 on every x86-64 kind (Intel with AMX, AMD Zen 4, AMD Zen 3),
# AVX-512 VNNI too on Intel with AMX and Zen 4. Every test below runs on each; a path's own cases skip only where the
# CPU lacks its instructions, and the whole file only off x86-64/AVX2, where quantized weights are refused with a
# clear error and nothing here is promised.
pytestmark = needs_native_kernels
FORMATS = list(quant.QUANTIZATIONS)  # the K-quants and Q5 formats: tests/test_kquants.py
QUANT_PATHS = [pytest.param(p, marks=pytest.mark.skipif(not kernels.cpu_has(p),
                                                        reason=f"this CPU lacks the {p} instructions"))
               for p in kernels.QUANT_PATHS]


def kernel_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it: quantized per row and per block of 32 to int8, dequantized in float64."""
    M, K = x.shape
    qx = torch.empty(M, K, dtype=torch.int8)
    dx = torch.empty(M, K // 32)
    sx = torch.empty(M, K // 32, dtype=torch.int32)
    kernels.library().peagle_quantize_rows_q8(x.data_ptr(), K, M, K, 0, qx.data_ptr(), dx.data_ptr(), sx.data_ptr())
    assert torch.equal(sx, qx.view(M, -1, 32).sum(-1, dtype=torch.int32))
    assert qx.abs().max() <= 127
    return (qx.double().view(M, -1, 32) * dx.double()[..., None]).view(M, K)


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_a_float64_reference(fmt, path, one_thread):
    torch.manual_seed(0)
    N, K = 203, 576  # N not a multiple of the 8-column groups: the padding columns must not leak
    w = torch.randn(N, K) * torch.rand(N, 1)  # rows of different scales
    qw = quant.QuantWeight.quantize(w, fmt, path=path)
    x = torch.randn(5, K).bfloat16()
    y = kernels.packed_linear(x, qw).double()
    ref = kernel_activations(x) @ qw.dequantize().double().T
    # fp32 accumulation and the one bf16 rounding of the output: well within 2^-8 of the largest output
    assert (y - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    exact = x.double() @ w.double().T  # and the quantization itself costs what its bit width says
    rel = ((y - exact).norm() / exact.norm()).item()
    assert rel < {"q8_0": 0.01, "q4_1": 0.12, "q4_0": 0.15}[fmt]


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_largest_codes_never_saturate_the_integer_sums(fmt, path, one_thread):
    """AVX2 sums a 4-bit block's eight byte products in int16 (at most 8 x 2 x 15 x 127 = 30,480) and a Q8_0
    chunk's in int16 pairs (2 x 128 x 127 = 32,512): blocks of the largest codes times activations of the largest
    magnitude, of both signs, in every row of a register block, must come out exact."""
    block_bytes = quant.FORMATS[fmt].block_bytes
    N, K = 16, 96
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    blocks = np.zeros((N * K // 32, block_bytes), dtype=np.uint8)
    blocks[:, :2] = one  # d = 1 (Q4_1's minimum m = 0)
    blocks[:, block_bytes - (32 if fmt == "q8_0" else 16):] = 0x80 if fmt == "q8_0" else 0xFF  # q8 -128, q4 15
    qw = quant.QuantWeight.from_blocks(torch.from_numpy(blocks), fmt, N, K, path=path)
    x = torch.ones(9, K).bfloat16()
    x[1::2] = -1  # every code +127 in even rows, -127 in odd ones
    y = kernels.packed_linear(x, qw).double()
    ref = kernel_activations(x) @ qw.dequantize().double().T
    assert ref.abs().min() > 600  # the sums are at their largest (Q4_0: 7 x 96 = 672)
    assert torch.allclose(y, ref, rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_blocks_follow_the_reference_rules(fmt):
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0] * 8, [3.0] * 32])
    qw = quant.QuantWeight.quantize(w, fmt)
    back = qw.dequantize()
    assert torch.allclose(back[1], torch.full((32,), 3.0), rtol=1e-3)  # a constant block is exact up to fp16
    assert (back[0] - w[0]).abs().max() <= {"q8_0": 0.01, "q4_1": 0.06, "q4_0": 0.13}[fmt]


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_computes_the_same_bits_in_any_batch_and_thread_count(fmt, path):
    torch.manual_seed(1)
    qw = quant.QuantWeight.quantize(torch.randn(100, 192), fmt, path=path)
    x = torch.randn(33, 192).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernels.packed_linear(x[i:i + 1], qw) for i in range(33)])
        for rows in (3, 8, 17, 33):
            assert torch.equal(kernels.packed_linear(x[:rows], qw), alone[:rows]), rows
        torch.set_num_threads(2)
        assert torch.equal(kernels.packed_linear(x, qw), alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not kernels.cpu_has("avx512-vnni"), reason="this CPU lacks the avx512-vnni instructions")
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_gives_the_same_bits(fmt, one_thread):
    """The integer dot products are exact however they are summed, so VNNI's register blocks of up to 8 rows give
    AVX2's bits for every row count (a model's outputs do not depend on the machine's instruction set)."""
    torch.manual_seed(4)
    w = torch.randn(203, 576) * torch.rand(203, 1)
    blocks = quant.quantize_blocks(w, fmt)
    avx2, vnni = (quant.QuantWeight.from_blocks(blocks, fmt, 203, 576, path=p) for p in ("avx2", "avx512-vnni"))
    x = torch.randn(19, 576).bfloat16()
    for rows in (1, 2, 4, 7, 8, 9, 19):
        assert torch.equal(kernels.packed_linear(x[:rows], vnni), kernels.packed_linear(x[:rows], avx2)), rows


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_register_block_remainders_keep_every_rows_bits(fmt, path):
    """Every row count from 1 to 33 (each register block size and every remainder of the row tiles) and an odd
    number of 8-column groups whose last one is partial (the 16-column blocks' lone last group): each row's
    outputs are its one-row bits, on one thread and two, and the same on every path."""
    torch.manual_seed(5)
    N, K = 197, 96  # 25 groups, the last holding 5 columns
    blocks = quant.quantize_blocks(torch.randn(N, K) * torch.rand(N, 1), fmt)
    qw = quant.QuantWeight.from_blocks(blocks, fmt, N, K, path=path)
    other = quant.QuantWeight.from_blocks(blocks, fmt, N, K, path="avx2")
    x = torch.randn(33, K).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernels.packed_linear(x[i:i + 1], qw) for i in range(33)])
        assert torch.equal(alone, kernels.packed_linear(x, other))
        for rows in range(2, 34):
            assert torch.equal(kernels.packed_linear(x[33 - rows:], qw), alone[33 - rows:]), rows
        torch.set_num_threads(2)
        for rows in (5, 13, 33):
            assert torch.equal(kernels.packed_linear(x[:rows], qw), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


def test_the_fastest_quantized_path_is_chosen():
    want = next(p for p in kernels.QUANT_PATHS if kernels.cpu_has(p))
    assert kernels.quant_path() == want
    assert quant.QuantWeight.quantize(torch.randn(8, 32), "q4_0").path == want
    with pytest.raises(ValueError, match="does not run here"):
        quant.QuantWeight.quantize(torch.randn(8, 32), "q4_0", path="neon")


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_lookup_dequantizes_exactly_the_rows_asked_for(fmt):
    torch.manual_seed(3)
    qw = quant.QuantWeight.quantize(torch.randn(37, 96), fmt)
    emb = quant.QuantEmbedding(qw)
    ids = torch.tensor([[0, 36, 5], [8, 8, 17]])
    assert torch.equal(emb(ids), qw.dequantize(ids.reshape(-1)).bfloat16().reshape(2, 3, 96))
    assert torch.equal(emb.table(), qw.dequantize().bfloat16())
    with pytest.raises(IndexError, match=r"\[0, 37\)"):
        emb(torch.tensor([37]))


def write_gguf(path, tensors: dict, arch: str = "llama") -> None:
    """A GGUF file from (numpy array, GGML type) pairs, written with the gguf package."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    for name, (data, kind) in tensors.items():
        if kind == "F32" or (kind == "BF16" and data.dtype != np.uint8):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CONFIG = {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1}


def test_gguf_blocks_read_back_bit_for_bit(tmp_path):
    torch.manual_seed(2)
    blocks = {fmt: quant.quantize_blocks(torch.randn(64, 96), fmt) for fmt in FORMATS}
    tensors = {"blk.0.ffn_up.weight": (blocks["q4_0"].numpy(), "Q4_0"),
               "blk.0.ffn_gate.weight": (blocks["q4_1"].numpy(), "Q4_1"),
               "blk.0.ffn_down.weight": (blocks["q8_0"].numpy(), "Q8_0"),
               "blk.0.attn_norm.weight": (np.linspace(0, 1, 96, dtype=np.float32), "F32")}
    write_gguf(tmp_path / "m.gguf", tensors)
    got = read_tensors(tmp_path / "m.gguf", CONFIG)
    assert got["layers.0.mlp.up_proj.weight"][0] == "q4_0"
    for name, fmt in (("up_proj", "q4_0"), ("gate_proj", "q4_1"), ("down_proj", "q8_0")):
        assert torch.equal(got[f"layers.0.mlp.{name}.weight"][1], blocks[fmt])
        # and through the kernel's layout back to the same values
        qw = quant.QuantWeight.from_blocks(blocks[fmt], fmt, 64, 96)
        assert torch.equal(qw.dequantize(), _gguf_dequantize(blocks[fmt], fmt, 64, 96))
    assert torch.equal(got["layers.0.input_layernorm.weight"],
                       torch.linspace(0, 1, 96, dtype=torch.float32).to(torch.bfloat16))


def test_bf16_tensors_read_back_as_llama_cpp_writes_them(tmp_path):
    """llama.cpp's converter writes BF16 as raw 2-byte values, which the gguf reader hands out as bytes."""
    import gguf

    values = torch.randn(8, 96).to(torch.bfloat16)
    raw = gguf.quants.quantize(values.float().numpy(), gguf.GGMLQuantizationType.BF16)
    write_gguf(tmp_path / "b.gguf", {"blk.0.ffn_up.weight": (raw, "BF16")})
    got = read_tensors(tmp_path / "b.gguf", CONFIG)["layers.0.mlp.up_proj.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, values)


def _gguf_dequantize(blocks: torch.Tensor, fmt: str, n: int, k: int) -> torch.Tensor:
    """The gguf package's own dequantizer: the reference for what the file's blocks mean."""
    import gguf

    kind = gguf.GGMLQuantizationType[fmt.upper()]
    return torch.from_numpy(gguf.dequantize(blocks.numpy(), kind).astype(np.float32)).reshape(n, k)


def test_unsupported_tensor_types_are_named(tmp_path):
    import gguf

    _, q3k_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q3_K]
    write_gguf(tmp_path / "k.gguf", {"blk.0.ffn_up.weight": (np.zeros((4, q3k_bytes), dtype=np.uint8), "Q3_K")})
    with pytest.raises(ValueError) as e:
        read_tensors(tmp_path / "k.gguf", CONFIG)
    msg = str(e.value)
    assert "Q3_K" in msg and "blk.0.ffn_up.weight" in msg
    for name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "llama-quantize", "Q4_K_M", "--quantization"):
        assert name in msg


def test_a_truncated_gguf_is_a_clear_error(tmp_path):
    blocks = quant.quantize_blocks(torch.randn(64, 96), "q8_0")
    write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (blocks.numpy(), "Q8_0")})
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_tensors(tmp_path / "t.gguf", CONFIG)
    (tmp_path / "h.gguf").write_bytes(data[:40])  # cut inside the header
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_tensors(tmp_path / "h.gguf", CONFIG)


def test_quantization_refuses_a_gguf_and_unknown_formats(tiny_llama):
    with pytest.raises(ValueError, match="already quantized"):
        TargetModel.from_pretrained(embedded_gguf_path(), quantization="q4_0")
    with pytest.raises(ValueError, match="q4_0, q4_1, q8_0"):
        TargetModel.from_pretrained(tiny_llama, quantization="q5_k")


@pytest.fixture(scope="module")
def gguf_target():
    return TargetModel.from_pretrained(embedded_gguf_path())


def test_the_embedded_gguf_keeps_its_blocks_and_means_the_embedded_weights(gguf_target, smollm2_dir):
    """Its Q4_1 layers and Q8_0 embedding are held as stored, with no float copy, and they dequantize to exactly
    the bf16 weights of the embedded target (which was converted from this file)."""
    q = gguf_target
    assert q.weights == "q4_1, lm_head q8_0"
    assert q.quantized and q.lm_head_packed is q.embed_tokens.quant  # tied: one copy of the table
    float_matrices = [n for n, p in q.named_parameters() if p is not None and p.dim() == 2]
    assert float_matrices == []
    ref = TargetModel.from_pretrained(smollm2_dir)
    for i in (0, 17, 29):
        a, b = q.layers[i], ref.layers[i]
        # q/k unpermuted
        assert torch.equal(a.self_attn.qkv.packed.dequantize().bfloat16(), b.self_attn.qkv.packed.unpack())
        assert torch.equal(a.mlp.gate_up.packed.dequantize().bfloat16(), b.mlp.gate_up.packed.unpack())
        assert torch.equal(a.mlp.down_packed.dequantize().bfloat16(), b.mlp.down_packed.unpack())
        assert torch.equal(a.input_layernorm.weight, b.input_layernorm.weight)
    assert torch.equal(q.input_embeddings(), ref.embed_tokens.weight)
    weight_bytes = sum(w.nbytes for la in q.layers for w in (la.self_attn.qkv.packed, la.self_attn.o_packed,
                                                              la.mlp.gate_up.packed, la.mlp.down_packed))
    weight_bytes += q.lm_head_packed.nbytes
    assert weight_bytes < 0.40 * ref.weight_bytes()  # under 40% of the bf16 weights


def test_gguf_tokenizer_and_chat_template_come_from_the_file(smollm2_dir):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(config_dir(embedded_gguf_path()))
    ref = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "def add(a, b): return a + b  # héllo"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, add_generation_prompt=True)


# Every K of both methods, mixed windows and both kinds of tree, at batch sizes 1 to 8, on the VNNI block products
# (the float model runs every case of test_lossless_smollm2.py)
GGUF_CASES = [("peagle", 1, 8), ("peagle", 7, 5), ("eagle3", 3, 8), ("eagle3", 7, 1), ("peagle", "0-3 per request", 6),
              ("peagle", "tree", 4), ("eagle3", "tree", 3)]


def test_greedy_speculation_equals_plain_greedy_on_the_embedded_gguf(gguf_target, one_thread):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(config_dir(embedded_gguf_path()))
    _assert_lossless(gguf_target, tok, GGUF_CASES)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_greedy_speculation_equals_plain_greedy_with_online_quantization(fmt, smollm2_dir, one_thread):
    from transformers import AutoTokenizer

    target = TargetModel.from_pretrained(smollm2_dir, quantization=fmt)
    assert target.weights == fmt if fmt == "q8_0" else f"{fmt}, lm_head q8_0"
    cases = [("peagle", 3, 4), ("eagle3", 7, 3), ("peagle", "0-3 per request", 5)]
    # with the Q8_0 drafter that the engine gives a quantized target
    _assert_lossless(target, AutoTokenizer.from_pretrained(smollm2_dir), cases, drafter_quantization="q8_0")


def _assert_lossless(target: TargetModel, tok, cases, drafter_quantization: str | None = None) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    alone = LLMEngine(target, tok, max_num_seqs=1, max_model_len=256)
    reference = [alone.generate([p], params, chat=True)[0].token_ids for p in PROMPTS]
    heads = {m: load_head(resolve_head(DEFAULT_HEADS[m]), target.input_embeddings()).pack_(drafter_quantization)
             for m in DEFAULT_HEADS}
    assert all(h.weights == (drafter_quantization or "bf16") for h in heads.values())
    for method, k, batch in cases:
        assert_case_lossless(target, tok, heads[method], method, k, batch, reference, target.weights)


def test_the_weight_format_is_named_with_the_kernels(gguf_target):
    """What the stats line, --json, /v1/models and bench metadata show (they all read engine.kernels)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(config_dir(embedded_gguf_path()))
    engine = LLMEngine(gguf_target, tok, max_num_seqs=1, max_model_len=64)
    assert engine.kernels["weights"] == "q4_1, lm_head q8_0"
    assert engine.kernels["block_kernels"] in kernels.QUANT_PATHS
    assert engine.kernels["greedy_bit_exact"] is True


def test_the_speculative_config_picks_the_drafters_block_format():
    """"quantization" in the speculative config quantizes the drafter of a bf16 target (it streams a quarter of
    the bytes at q4_0): the drafts change, never the output. One owner decides the format (quant.drafter_quantization),
    and the config refuses what peagle does not run."""
    from peagle.config import DRAFTER_FORMATS, SpeculativeConfigError

    assert DRAFTER_FORMATS == quant.QUANTIZATIONS
    assert quant.drafter_quantization(None, target_quantized=False) is None
    assert quant.drafter_quantization(None, target_quantized=True) == quant.DRAFTER_QUANTIZATION
    assert quant.drafter_quantization("q4_0", target_quantized=True) == "q4_0"
    with pytest.raises(SpeculativeConfigError, match="quantization.*q4_0, q4_1, q8_0"):
        SpeculativeConfig.parse({"method": "peagle", "quantization": "fp8"})
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLMEngine.from_pretrained(None, None, max_num_seqs=1, max_model_len=256)
    spec = LLMEngine.from_pretrained(None, {"method": "peagle", "num_speculative_tokens": 3, "quantization": "q4_0"},
                                     max_num_seqs=1, max_model_len=256, speculation_policy="fixed")
    assert spec.kernels["weights"] == "bf16" and spec.kernels["drafter_weights"] == "q4_0"
    assert spec.kernels["block_kernels"] == kernels.quant_path() and "block_kernels" not in plain.kernels
    for prompt in PROMPTS[:2]:
        assert spec.generate([prompt], params, chat=True)[0].token_ids == \
            plain.generate([prompt], params, chat=True)[0].token_ids
    assert spec.stats.num_accepted_tokens > 0
