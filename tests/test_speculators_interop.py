"""Heads exported in the speculators layout load in speculators 0.9.0 (the reference P-EAGLE implementation) with
every tensor equal, and its forward computes what ours does in fp32.

speculators is installed by `bash scripts/setup.sh --test` without its dependencies (they pull CUDA builds of torch
extensions); what its import needs is installed beside it. Its verifier is the tiny target folder on disk, so nothing
is fetched."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from peagle.model.checkpoint import random_head, save_head
from peagle.model.drafter import Drafter, DrafterConfig
from peagle.model.export import target_embeddings
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetConfig
from peagle.train.cod import Elements
from peagle.train.objective import TeacherSeq, cod_forward
from tests.conftest import make_tiny_model

pytest.importorskip("speculators", reason="speculators is installed by `bash scripts/setup.sh --test`")

V, H, VD, MASK_ID = 128, 64, 96, 5
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("verifier"), "llama", num_hidden_layers=8, vocab_size=V)


def trained_looking_head(target, method: str, norm_before_residual: bool) -> Drafter:
    """A random fp32 head for `target` with a pruned draft vocab and non-trivial norms, as training leaves one."""
    tc = TargetConfig.from_hf(json.loads((target / "config.json").read_text()))
    base = random_head(tc, target_embeddings(target).float(), method, num_layers=2,
                       mask_token_id=MASK_ID if method == "peagle" else None, seed=1, dtype=torch.float32)
    config = DrafterConfig(**{**base.config.as_dict(), "draft_vocab_size": VD,
                              "norm_before_residual": norm_before_residual, "extra": {}})
    head = Drafter(config)
    g = torch.Generator().manual_seed(2)
    used = torch.randperm(V, generator=g)[:VD].sort().values
    state = base.state_dict()
    state["lm_head.weight"] = torch.randn(VD, H, generator=g) * 0.3
    state["d2t"], state["t2d"] = used - torch.arange(VD), torch.zeros(V, dtype=torch.bool).index_fill(0, used, True)
    for name in state:
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.1 * torch.randn(H, generator=g)
    if method == "peagle":
        state["mask_hidden"] = torch.randn(1, 1, 3 * H, generator=g)
    head.load_state_dict(state)
    return head.eval().requires_grad_(False)


def load_in_speculators(path):
    from speculators.model import SpeculatorModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SpeculatorModel.from_pretrained(str(path)).float().eval()


def captured_logits(model):
    """The logits of the model's lm_head on its next call."""
    out = []
    model.lm_head.register_forward_hook(lambda module, args, result: out.append(result.detach()))
    return out


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_speculators_loads_the_export_and_matches_our_forward(target, tmp_path, method, norm_before_residual):
    ours = trained_looking_head(target, method, norm_before_residual)
    save_head(ours, tmp_path, layout="speculators", verifier=str(target), dtype=torch.float32)
    theirs = load_in_speculators(tmp_path)
    assert type(theirs).__name__ == ("PEagleDraftModel" if method == "peagle" else "Eagle3DraftModel")
    assert theirs.config.norm_before_residual is norm_before_residual

    # every tensor we wrote is the one it holds (its extra verifier_* tensors come from the target, not from us)
    mine = {k.replace("midlayer.", "layers.0.", 1): v for k, v in ours.state_dict().items()}
    held = theirs.state_dict()
    assert set(mine) <= set(held), set(mine) - set(held)
    for name, value in mine.items():
        assert torch.equal(held[name].to(value.dtype), value), name

    n = 24
    g = torch.Generator().manual_seed(3)
    tokens, feats = torch.randint(10, V, (n,), generator=g), torch.randn(n, 3 * H, generator=g)
    logits = captured_logits(theirs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "peagle":
            anchor, depth = cod_sample_of_speculators(theirs, tokens, feats)
        else:  # one TTT step: the forward over every real row (later steps feed back drafts by its own rule)
            theirs(feats[None], tokens[None], torch.zeros(1, n, dtype=torch.long),
                   position_ids=torch.arange(n)[None], ttt_steps=1)
    if method == "peagle":
        # speculators' element (anchor p, depth 0) reads token p and feature p at position p; ours reads token p+1,
        # so our sequence is theirs shifted right by one token
        seq = TeacherSeq(torch.cat([torch.zeros(1, dtype=torch.long), tokens]),
                         torch.cat([feats, torch.zeros(1, 3 * H)]), torch.zeros(n + 1, VD), torch.zeros(n + 1))
        el = Elements(anchor, depth, torch.ones_like(anchor, dtype=torch.bool), torch.zeros_like(anchor))
        expected = ours.logits(cod_forward(ours, seq, el))
        assert bool((depth > 0).any())
    else:
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        expected = ours.logits(ours(tokens[None], feats[None], BatchLayout.dense(torch.arange(n)[None], mask),
                                    None))[0]
    got = logits[0][0].float()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def cod_sample_of_speculators(model, tokens, feats) -> tuple[torch.Tensor, torch.Tensor]:
    """Run speculators' P-EAGLE training forward on one sequence and return the COD sample (anchor, depth) it drew."""
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.peagle import core

    drawn = []

    def recording(*args, **kwargs):
        drawn.append(draw(*args, **kwargs))
        return drawn[-1]

    n = tokens.numel()
    loss_mask = torch.ones(1, n)
    loss_mask[0, :4] = 0
    draw, core.generate_cod_sample_indices = core.generate_cod_sample_indices, recording
    try:
        model(feats[None], tokens[None], torch.zeros(1, n, dtype=torch.long), loss_mask=loss_mask,
              verifier_last_hidden_states=torch.randn(1, n, H), loss_config=resolve_loss_config("kl_div", "eager"),
              num_depths=4, down_sample_ratio=0.7, down_sample_ratio_min=0.2)
    finally:
        core.generate_cod_sample_indices = draw
    (anchor, depth), = drawn
    return anchor, depth
