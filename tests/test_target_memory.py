"""A packed bf16 target holds its projections once: TargetModel.pack_ drops each float weight that a packed copy
runs, and its logits and features stay those of a target that kept them, bit for bit. Where nothing is packed
(PEAGLE_CPU_KERNELS=off, fp32) the floats stay."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from peagle.model.layers import BatchLayout
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model, needs_native_kernels

# Llama with an untied and a tied LM head (one native call per layer), Qwen2 (biases: the layers run as modules)
MODELS = {"llama-untied": ("llama", {"tie_word_embeddings": False}),
          "llama-tied": ("llama", {"tie_word_embeddings": True}), "qwen2": ("qwen2", {})}


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    model_type, overrides = MODELS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param), model_type, seed=11, **overrides)


def float_matrices(target: TargetModel) -> list[str]:
    return [name for name, p in target.named_parameters() if p.dim() == 2]


def run(target: TargetModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prefill of two rows and three decode steps: each forward's logits and features."""
    cache = target.new_cache(2, 32)
    tokens = torch.randint(3, target.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    out, n = [], tokens.shape[1]
    for _ in range(4):
        positions = torch.arange(n - tokens.shape[1], n).expand(2, -1)
        step = target(tokens, BatchLayout.build(torch.arange(2), positions), cache, num_logits=None)
        out.append((step.logits, step.features))
        tokens, n = step.logits[:, -1:].argmax(-1), n + 1
    return out


@needs_native_kernels
def test_a_packed_target_holds_no_float_projection_and_computes_the_same_bits(model_dir, monkeypatch, one_thread):
    target = TargetModel.from_pretrained(model_dir)
    with monkeypatch.context() as m:
        m.setattr(TargetModel, "_release_packed_floats", lambda self: None)  # the target as it was: floats kept
        kept = TargetModel.from_pretrained(model_dir)
    assert float_matrices(target) == ["embed_tokens.weight"]  # lookups read it (and a tied LM head is packed from it)
    assert all(w is None for la in target.layers for w in (la.self_attn.qkv.weight, la.self_attn.q_proj.weight,
                                                           la.self_attn.o_proj.weight, la.mlp.gate_up.weight,
                                                           la.mlp.up_proj.weight, la.mlp.down_proj.weight))
    assert len(float_matrices(kept)) == 1 + 7 * target.config.num_layers + (target.lm_head is not None)
    # what stays was copied out of the mapped file (torch's own, resizable storage), which then goes as a whole
    assert all(t.untyped_storage().resizable() for t in [*target.parameters(), *target.buffers()])
    assert not kept.embed_tokens.weight.untyped_storage().resizable()  # the check can fail: this one is mapped
    assert target.weights == kept.weights == "bf16" and target.weight_bytes() == kept.weight_bytes()
    assert target.device == kept.device and (target.native_layers is None) == (kept.native_layers is None)
    for (logits, features), (ref_logits, ref_features) in zip(run(target), run(kept)):
        assert torch.equal(logits, ref_logits) and torch.equal(features, ref_features)
    # a head starts from the same LM head bits, and packing again (another path) unpacks the very weights
    assert torch.equal(target.output_embeddings().view(torch.int16), kept.output_embeddings().view(torch.int16))
    target.pack_()
    assert float_matrices(target) == ["embed_tokens.weight"]
    assert torch.equal(target.layers[1].mlp.gate_up.packed.data, kept.layers[1].mlp.gate_up.packed.data)
    assert torch.equal(target.lm_head_packed.data, kept.lm_head_packed.data)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(run(target), run(kept)))


def test_an_unpacked_target_keeps_its_floats(model_dir):
    """fp32 weights are never packed: every float stays, as F.linear reads it."""
    target = TargetModel.from_pretrained(model_dir, dtype=torch.float32)
    assert target.layers[0].mlp.down_packed is None
    assert len(float_matrices(target)) == 1 + 7 * target.config.num_layers + (target.lm_head is not None)


def test_without_native_kernels_the_floats_stay(tiny_llama):
    """PEAGLE_CPU_KERNELS=off (read once per process, so a fresh one): nothing is packed, nothing released."""
    script = ("import sys; from peagle.model.target import TargetModel; t = TargetModel.from_pretrained(sys.argv[1]);"
              "assert t.layers[0].self_attn.qkv.packed is None and t.native_layers is None;"
              "assert all(p is not None for la in t.layers for p in (la.self_attn.qkv.weight, la.mlp.gate_up.weight,"
              " la.self_attn.o_proj.weight, la.mlp.down_proj.weight)) and t.lm_head_weight is not None; print('kept')")
    out = subprocess.run([sys.executable, "-c", script, str(tiny_llama)], capture_output=True, text=True,
                         env={**os.environ, "PEAGLE_CPU_KERNELS": "off", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "kept", out.stderr[-2000:]
