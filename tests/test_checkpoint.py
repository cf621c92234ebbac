"""Head checkpoints (docs/design.md, "Checkpoints"): every key, dtype and shape of the vLLM and speculators
layouts, round trips, SpecForge-style names, refusals, and the `peagle export` command."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.cli import main
from peagle.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig, SpeculativeConfigError
from peagle.model.checkpoint import load_head, random_head, save_head
from peagle.model.target import TargetConfig

MASK_ID = 5
V, H, VD, L = 512, 64, 300, 8


@pytest.fixture(scope="module")
def target() -> TargetConfig:
    return TargetConfig.from_hf(dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=128,
                                     num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=1024))


@pytest.fixture(scope="module")
def embeddings() -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(0))


def pruned(head):
    """Give a random head a pruned draft vocab, as training does."""
    from peagle.model.drafter import Drafter, DrafterConfig

    c = head.config
    config = DrafterConfig(**{**c.as_dict(), "draft_vocab_size": VD, "extra": {}})
    out = Drafter(config)
    state = head.state_dict()
    used = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:VD].sort().values
    state["lm_head.weight"] = state["lm_head.weight"][:VD]
    state["d2t"] = used - torch.arange(VD)
    state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, used, True)
    out.load_state_dict(state)
    return out.to(head.fc.weight.dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def peagle_head(target, embeddings):
    return pruned(random_head(target, embeddings, "peagle", num_layers=2, mask_token_id=MASK_ID, seed=3,
                              dtype=torch.float32))


@pytest.fixture(scope="module")
def eagle3_head(target, embeddings):
    return random_head(target, embeddings, "eagle3", num_layers=1, seed=4, dtype=torch.float32)


def layer_keys(prefix, in_dim, hidden_norm):
    q, kv, inter = 4 * 16, 2 * 16, 128
    keys = {f"{prefix}.self_attn.q_proj.weight": [q, in_dim], f"{prefix}.self_attn.k_proj.weight": [kv, in_dim],
            f"{prefix}.self_attn.v_proj.weight": [kv, in_dim], f"{prefix}.self_attn.o_proj.weight": [H, q],
            f"{prefix}.mlp.gate_proj.weight": [inter, H], f"{prefix}.mlp.up_proj.weight": [inter, H],
            f"{prefix}.mlp.down_proj.weight": [H, inter], f"{prefix}.input_layernorm.weight": [H],
            f"{prefix}.post_attention_layernorm.weight": [H]}
    if hidden_norm:
        keys[f"{prefix}.hidden_norm.weight"] = [H]
    return keys


def expected_tensors(layer0: str, parallel: bool, num_layers: int, vd: int, embeddings: bool | None = None):
    shapes = {"fc.weight": [H, 3 * H], "norm.weight": [H], "lm_head.weight": [vd, H], "d2t": [vd], "t2d": [V]}
    shapes.update(layer_keys(layer0, 2 * H, hidden_norm=True))
    for i in range(1, num_layers):
        shapes.update(layer_keys(f"layers.{i}", H, hidden_norm=False))
    if parallel:
        shapes["mask_hidden"] = [1, 1, 3 * H]
    if parallel if embeddings is None else embeddings:
        shapes["embed_tokens.weight"] = [V, H]
    return shapes


def with_norm_before_residual(head):
    """The same weights under norm_before_residual = true (layer 0's residual is hidden_norm(h))."""
    from peagle.model.drafter import Drafter, DrafterConfig

    out = Drafter(DrafterConfig(**{**head.config.as_dict(), "norm_before_residual": True}))
    out.load_state_dict(head.state_dict())
    return out.to(head.fc.weight.dtype).eval().requires_grad_(False)


def check_tensors(path, expected):
    state = load_file(path / "model.safetensors")
    assert set(state) == set(expected)
    for name, shape in expected.items():
        assert list(state[name].shape) == shape, name
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert state[name].dtype == want, name
    return state


def draft_once(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens, feats = torch.randint(10, V, (1, 6), generator=g), torch.randn(1, 6, 3 * H, generator=g)
    args = (tokens, feats.to(head.fc.weight.dtype), torch.tensor([6]), torch.tensor([0]), torch.tensor([0]))
    if head.config.parallel_capable:
        return head.draft_parallel(*args, head.new_cache(1, 32), 4)
    return head.draft_chain(*args, head.new_cache(1, 32), 4)


# -- layouts ------------------------------------------------------------------------------------------------------
def test_vllm_layout_has_every_key_dtype_shape(peagle_head, tmp_path):
    save_head(peagle_head, tmp_path, layout="vllm")
    state = check_tensors(tmp_path, expected_tensors("midlayer", parallel=True, num_layers=2, vd=VD))
    assert torch.equal(state["d2t"], peagle_head.d2t) and torch.equal(state["t2d"], peagle_head.t2d)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == VD and cfg["vocab_size"] == V and cfg["target_hidden_size"] == H
    assert cfg["hidden_size"] == H and cfg["num_hidden_layers"] == 2 and cfg["head_dim"] == 16
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert cfg["max_position_embeddings"] == 1024
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]
    assert cfg["norm_before_residual"] is False
    assert cfg["mask_token_id"] == cfg["ptd_token_id"] == cfg["pard_token"] == MASK_ID
    assert cfg["tie_word_embeddings"] is False


def test_vllm_layout_eagle3_has_no_mask_fields(eagle3_head, tmp_path):
    save_head(eagle3_head, tmp_path, layout="vllm")
    check_tensors(tmp_path, expected_tensors("midlayer", parallel=False, num_layers=1, vd=V))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert not {"mask_token_id", "ptd_token_id", "pard_token"} & set(cfg)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_speculators_layout(peagle_head, eagle3_head, tmp_path, method):
    head = peagle_head if method == "peagle" else eagle3_head
    save_head(head, tmp_path, layout="speculators", verifier="org/target-model", verifier_architectures=["X"])
    # speculators 0.9 loads a head without embed_tokens as an all-zero table: every head carries it
    check_tensors(tmp_path, expected_tensors("layers.0", parallel=method == "peagle", embeddings=True,
                                             num_layers=head.config.num_layers, vd=head.config.draft_vocab_size))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == method
    assert cfg["architectures"] == ["PEagleSpeculator" if method == "peagle" else "Eagle3Speculator"]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["hidden_size"] == H and layer["vocab_size"] == V
    assert layer["num_hidden_layers"] == head.config.num_layers and layer["rope_theta"] == 50000.0
    assert cfg["draft_vocab_size"] == head.config.draft_vocab_size and cfg["target_hidden_size"] == H
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == method
    assert spec["proposal_methods"][0]["speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS
    assert spec["verifier"] == {"name_or_path": "org/target-model", "architectures": ["X"]}
    assert (cfg.get("mask_token_id") == MASK_ID) if method == "peagle" else ("mask_token_id" not in cfg)


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_round_trip(peagle_head, eagle3_head, embeddings, tmp_path, layout, norm_before_residual):
    heads = (peagle_head, eagle3_head)
    if norm_before_residual:
        heads = tuple(with_norm_before_residual(h) for h in heads)
        assert not torch.equal(draft_once(heads[0]), draft_once(peagle_head))  # the flag changes the drafts
    for head in heads:
        out = tmp_path / f"{layout}-{head.config.parallel_capable}"
        save_head(head, out, layout=layout, dtype=torch.float32)
        assert json.loads((out / "config.json").read_text())["norm_before_residual"] is norm_before_residual
        if head.config.parallel_capable or layout == "speculators":
            loaded = load_head(out, dtype=torch.float32)
        else:
            with pytest.raises(ValueError, match="embed_tokens"):
                load_head(out)
            loaded = load_head(out, target_embeddings=embeddings, dtype=torch.float32)
        assert loaded.config == head.config
        a, b = head.state_dict(), loaded.state_dict()
        assert set(a) == set(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        assert torch.equal(draft_once(head), draft_once(loaded))


def test_round_trip_bfloat16_keeps_drafts(peagle_head, tmp_path):
    save_head(peagle_head, tmp_path)
    loaded = load_head(tmp_path)  # bfloat16 by default
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    ref = copy.deepcopy(peagle_head).to(torch.bfloat16)
    assert torch.equal(draft_once(ref), draft_once(loaded))


def test_specforge_names_load(peagle_head, tmp_path):
    """SpecForge / wrapped checkpoints: `model.` prefixes, layer 0 as `layers.0.*`, ids only under eagle_config."""
    save_head(peagle_head, tmp_path / "ours", dtype=torch.float32)
    state = load_file(tmp_path / "ours" / "model.safetensors")
    renamed = {}
    for k, v in state.items():
        k = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k
        renamed[k if k == "lm_head.weight" else "model." + k] = v
    (tmp_path / "sf").mkdir()
    save_file(renamed, tmp_path / "sf" / "model.safetensors")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg.pop("draft_vocab_size")  # read from lm_head's shape
    cfg.pop("ptd_token_id"), cfg.pop("pard_token")
    (tmp_path / "sf" / "config.json").write_text(json.dumps(cfg))
    loaded = load_head(tmp_path / "sf", dtype=torch.float32)
    assert loaded.config.feature_layer_ids == (2, L // 2, L - 3) and loaded.config.draft_vocab_size == VD
    for k, v in peagle_head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_head_without_mask_hidden_refuses_parallel_drafting(eagle3_head, tmp_path):
    save_head(eagle3_head, tmp_path)
    head = load_head(tmp_path, target_embeddings=torch.zeros(V, H))
    spec = SpeculativeConfig.parse({"model": str(tmp_path), "method": "eagle3", "num_speculative_tokens": 3,
                                    "parallel_drafting": True})
    with pytest.raises(SpeculativeConfigError, match="mask_hidden") as e:
        spec.check_head(head.config.parallel_capable, str(tmp_path))
    assert "parallel_drafting" in str(e.value)
    SpeculativeConfig.parse({"parallel_drafting": False}).check_head(head.config.parallel_capable)


def test_bad_checkpoints_fail_clearly(peagle_head, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_head(tmp_path)
    save_head(peagle_head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(ValueError, match="norm_before_fc"):
        load_head(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("mask_hidden")
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mask_hidden"):
        load_head(tmp_path)


# -- peagle export ------------------------------------------------------------------------------------------------
def serve_line(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    line = out[-1]
    assert line.startswith("vllm serve ")
    spec = json.loads(line.split("--speculative-config ", 1)[1].strip("'"))
    return line, spec


def test_export_random_init_then_convert(tiny_llama, tmp_path, capsys):
    head_dir = tmp_path / "head"
    # A target without a tokenizer: the mask token cannot be picked, so the command asks for one.
    assert main(["export", "--random-init", "--target", str(tiny_llama), "--method", "peagle",
                 "--out", str(head_dir)]) == 2
    assert "--mask-token-id" in capsys.readouterr().err
    assert main(["export", "--random-init", "--target", str(tiny_llama), "--method", "peagle", "--num-layers", "2",
                 "--mask-token-id", "7", "--out", str(head_dir)]) == 0
    line, spec = serve_line(capsys)
    assert line.startswith(f"vllm serve {tiny_llama.resolve()} ")
    assert spec == {"model": str(head_dir.resolve()), "method": "eagle3",
                    "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS, "parallel_drafting": True}
    head = load_head(head_dir)
    assert head.config.mask_token_id == 7 and head.config.num_layers == 2 and head.mask_hidden is not None

    spec_dir = tmp_path / "spec"
    assert main(["export", str(head_dir), "--format", "speculators", "--out", str(spec_dir),
                 "--target", str(tiny_llama), "--num-speculative-tokens", "5"]) == 0
    line, spec = serve_line(capsys)
    assert spec["num_speculative_tokens"] == 5 and spec["parallel_drafting"] is True
    cfg = json.loads((spec_dir / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_llama.resolve())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    back = tmp_path / "back"
    assert main(["export", str(spec_dir), "--out", str(back)]) == 0  # the verifier names the target
    line, _ = serve_line(capsys)
    assert line.startswith(f"vllm serve {tiny_llama.resolve()} ")
    for k, v in head.state_dict().items():
        assert torch.equal(load_head(back).state_dict()[k], v), k


def test_export_eagle3(tiny_llama, tmp_path, capsys):
    out = tmp_path / "e3"
    assert main(["export", "--random-init", "--target", str(tiny_llama), "--method", "eagle3", "--out", str(out)]) == 0
    _, spec = serve_line(capsys)
    assert spec["num_speculative_tokens"] == 3 and "parallel_drafting" not in spec
    state = load_file(out / "model.safetensors")
    assert "mask_hidden" not in state and "embed_tokens.weight" not in state
    # Re-export without the target: the serve line has a placeholder and says so.
    assert main(["export", str(out), "--out", str(tmp_path / "e3b")]) == 0
    captured = capsys.readouterr()
    assert "vllm serve TARGET_MODEL" in captured.out and "--target" in captured.err
    assert set(load_file(tmp_path / "e3b" / "model.safetensors")) == set(state)
    # The speculators layout carries the target's embedding table, so it needs to know the target.
    assert main(["export", str(out), "--format", "speculators", "--out", str(tmp_path / "e3s")]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["export", str(out), "--format", "speculators", "--target", str(tiny_llama),
                 "--out", str(tmp_path / "e3s")]) == 0
    capsys.readouterr()
    from peagle.model.export import target_embeddings

    written = load_file(tmp_path / "e3s" / "model.safetensors")["embed_tokens.weight"]
    assert torch.equal(written, target_embeddings(tiny_llama).to(written.dtype))


@pytest.mark.parametrize("argv, message", [
    (["export", "--out", "X"], "HEAD"),
    (["export", "does-not-exist", "--out", "X"], "does-not-exist"),
    (["export", "--random-init", "--target", "TINY", "--method", "eagle3", "--mask-token-id", "3", "--out", "X"],
     "--mask-token-id"),
    (["export", "--random-init", "--target", "TINY", "--mask-token-id", "99999", "--out", "X"], "vocabulary"),
    (["export", "--random-init", "--target", "TINY", "--num-layers", "0", "--mask-token-id", "3", "--out", "X"],
     "--num-layers"),
    (["export", "--random-init", "--target", "TINY", "--mask-token-id", "3", "--num-speculative-tokens", "0",
      "--out", "X"], "--num-speculative-tokens"),
])
def test_export_errors(tiny_llama, tmp_path, capsys, argv, message):
    argv = [str(tiny_llama) if a == "TINY" else (str(tmp_path / "x") if a == "X" else a) for a in argv]
    try:  # a flag out of range stops in argparse (exit 2), the rest return 2 after their own checks
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "peagle export: error:" in err and message in err


def test_export_unsupported_target(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    assert main(["export", "--random-init", "--target", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "gpt2" in err and "llama" in err and "qwen3" in err


def test_compact_peagle_head_keeps_the_learned_mask_row(tmp_path):
    """Bundled heads ship without the embedding table: only the mask row, the rest comes from the target."""
    import torch

    from peagle.model.checkpoint import MASK_ROW, load_head, random_head, save_head
    from peagle.model.target import TargetConfig

    cfg = TargetConfig.from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "rope_theta": 10000.0})
    target_emb = torch.randn(64, 32)
    head = random_head(cfg, target_emb, "peagle", mask_token_id=5, dtype=torch.float32)
    with torch.no_grad():
        head.embed_tokens.weight[5] = 7.0  # a "learned" mask row
    save_head(head, tmp_path, include_embeddings=False, dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in f.keys() and list(f.get_slice(MASK_ROW).get_shape()) == [1, 32]
    loaded = load_head(tmp_path, target_embeddings=target_emb, dtype=torch.float32)
    assert torch.equal(loaded.embed_tokens.weight[5], torch.full((32,), 7.0))
    assert torch.equal(loaded.embed_tokens.weight[:5], target_emb[:5])


def test_export_completes_a_compact_peagle_head(tiny_llama, tmp_path, capsys):
    """`peagle export` of a compact head writes the full embedding table vLLM needs: the target's, with the
    head's learned mask row in it."""
    import torch
    from safetensors import safe_open

    from peagle.model.checkpoint import random_head, save_head
    from peagle.model.target import TargetConfig

    cfg = TargetConfig.from_hf(json.loads((tiny_llama / "config.json").read_text()))
    with safe_open(tiny_llama / "model.safetensors", "pt") as f:
        target_emb = f.get_tensor("model.embed_tokens.weight")
    head = random_head(cfg, target_emb, "peagle", mask_token_id=5, dtype=torch.bfloat16)
    with torch.no_grad():
        head.embed_tokens.weight[5] = 3.0
    save_head(head, tmp_path / "compact", include_embeddings=False)
    assert main(["export", str(tmp_path / "compact"), "--out", str(tmp_path / "full")]) == 2
    assert "--target" in capsys.readouterr().err  # a compact head alone cannot say whose table completes it
    assert main(["export", str(tmp_path / "compact"), "--out", str(tmp_path / "full"), "--target", str(tiny_llama)]) == 0
    with safe_open(tmp_path / "full" / "model.safetensors", "pt") as f:
        emb = f.get_tensor("embed_tokens.weight")
        assert "mask_token_embedding" not in f.keys()
    assert emb.shape == target_emb.shape
    assert torch.equal(emb[5], torch.full_like(emb[5], 3.0))
    assert torch.equal(emb[:5], target_emb[:5]) and torch.equal(emb[6:], target_emb[6:])
