"""An engine's head looks its token rows up through the target's embedding (drafter.SharedEmbedding) instead of
holding a copy of the table, which a block-quantized target would have to dequantize whole: the drafts, the
acceptance counters and the output must be those of a head holding its own dequantized table, bit for bit."""
from __future__ import annotations

import random

import pytest
import torch

from peagle.config import SpeculativeConfig
from peagle.engine import LLMEngine, SamplingParams
from peagle.model import kernels
from peagle.model.checkpoint import MASK_ROW, load_head, random_head, save_head
from peagle.model.drafter import Drafter, SharedEmbedding
from peagle.model.quant import QuantEmbedding
from peagle.model.target import TargetModel
from tests.conftest import make_tiny_model, needs_native_kernels

MASK_ID = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("head-memory-target"), "llama", seed=5)


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    """A compact P-EAGLE head (as the bundled ones: no table, only its learned mask row, which differs from the
    target's row at that id) for the tiny target."""
    target = TargetModel.from_pretrained(model_dir)
    head = random_head(target.config, target.input_embeddings(), "peagle", mask_token_id=MASK_ID, seed=6)
    with torch.no_grad():
        head.embed_tokens.weight[MASK_ID] = torch.randn(target.config.hidden_size, generator=torch.Generator()
                                                        .manual_seed(7)).to(head.embed_tokens.weight.dtype)
    return save_head(head, tmp_path_factory.mktemp("head-memory-head"), include_embeddings=False)


def heads(target: TargetModel, head_dir) -> tuple[Drafter, Drafter]:
    """(the head with its own table, dequantized as before; the head sharing the target's embedding)."""
    return (load_head(head_dir, target_embeddings=target.input_embeddings()),
            load_head(head_dir, target_embeddings=target.embed_tokens))


def recorded(drafter: Drafter) -> list[torch.Tensor]:
    """Every batch of drafts the drafter returns, in order."""
    drafts, draft = [], drafter.draft_parallel

    def record(*args, **kwargs):
        out = draft(*args, **kwargs)
        drafts.append(out.clone())
        return out

    drafter.draft_parallel = record
    return drafts


def run(target: TargetModel, drafter: Drafter, prompts, params):
    spec = SpeculativeConfig.parse({"model": "head", "method": "eagle3", "num_speculative_tokens": 3,
                                    "parallel_drafting": True})
    engine = LLMEngine(target, None, drafter, spec, max_num_seqs=2, max_model_len=128, speculation_policy="fixed")
    drafts = recorded(drafter)
    outputs = [o.token_ids for o in engine.generate(prompts, params)]
    return outputs, drafts, engine.stats


def prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(4, 512) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


@needs_native_kernels
@pytest.mark.parametrize("quantization", ["q4_1", None])
def test_a_shared_embedding_drafts_as_the_heads_own_table(model_dir, head_dir, quantization, one_thread):
    """On a block-quantized target (its table a QuantEmbedding in q8_0, the head in q8_0 as the engine makes it) and
    on a bf16 one: the same rows, drafts, counters and outputs, and no [V, H] tensor in the sharing head."""
    target = TargetModel.from_pretrained(model_dir, quantization=quantization)
    assert isinstance(target.embed_tokens, QuantEmbedding) == (quantization is not None)
    own, shared = (h.pack_("q8_0" if quantization else None) for h in heads(target, head_dir))  # as the engine
    assert own.lm_head.weight is None and shared.midlayer.mlp.down_proj.weight is None  # the packed copy runs them
    assert isinstance(shared.embed_tokens, SharedEmbedding) and isinstance(own.embed_tokens, torch.nn.Embedding)
    V, H = target.config.vocab_size, target.config.hidden_size
    size = lambda d: sum(t.numel() * t.element_size() for t in d.state_dict().values())  # noqa: E731
    assert size(own) - size(shared) == V * H * 2 and "embed_tokens.weight" not in shared.state_dict()
    assert not any(t.data_ptr() == p.data_ptr() for t in shared.state_dict().values() for p in target.parameters())
    ids = torch.arange(V)
    assert torch.equal(shared.embed_tokens(ids), own.embed_tokens.weight)  # the learned mask row included
    assert not torch.equal(own.embed_tokens.weight[MASK_ID], target.input_embeddings()[MASK_ID].to(torch.bfloat16))

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLMEngine(target, None, max_num_seqs=2, max_model_len=128).generate(prompts(), params)]
    out_own, drafts_own, stats_own = run(target, own, prompts(), params)
    out_shared, drafts_shared, stats_shared = run(target, shared, prompts(), params)
    assert out_own == out_shared == plain
    assert len(drafts_own) > 5 and len(drafts_shared) == len(drafts_own)
    assert all(torch.equal(a, b) for a, b in zip(drafts_own, drafts_shared))
    assert stats_own == stats_shared and stats_own.num_draft_tokens > 0


def test_a_head_that_shares_the_table_saves_as_one_that_holds_it(model_dir, head_dir, tmp_path):
    """save_head writes an engine's head (sharing the target's table) as it writes the head with its own table."""
    from safetensors.torch import load_file

    target = TargetModel.from_pretrained(model_dir)
    own, shared = heads(target, head_dir)
    for include in (False, True):
        a = load_file(save_head(own, tmp_path / f"own-{include}", include_embeddings=include) / "model.safetensors")
        b = load_file(save_head(shared, tmp_path / f"shared-{include}", include_embeddings=include) /
                      "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert (MASK_ROW in a) != include
    if kernels.matmul_path() is not None:  # where the kernels run, packing releases the floats
        with pytest.raises(ValueError, match="packed for inference.*before packing"):
            save_head(shared.pack_(), tmp_path / "packed")


def test_a_shared_embedding_of_another_shape_is_refused(head_dir):
    other = torch.nn.Embedding(100, 64)
    with pytest.raises(ValueError, match="vocabulary of 512 and width 64.*100 x 64"):
        load_head(head_dir, target_embeddings=other)


@needs_native_kernels
def test_the_engine_shares_the_targets_embedding(model_dir, head_dir, one_thread):
    """LLMEngine.from_pretrained gives its head the target's embedding module, not a dequantized copy."""
    engine = LLMEngine.from_pretrained(str(model_dir), {"model": str(head_dir), "method": "eagle3",
                                                        "num_speculative_tokens": 3, "parallel_drafting": True},
                                       max_num_seqs=1, max_model_len=128, quantization="q4_1")
    assert isinstance(engine.drafter.embed_tokens, SharedEmbedding)
    assert engine.drafter.embed_tokens._target[0] is engine.target.embed_tokens
    assert engine.kernels["drafter_weights"] == "q8_0"
