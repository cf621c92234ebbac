"""`peagle export --format llama.cpp`: the EAGLE-3 draft GGUF that llama.cpp's draft-eagle3 loads, read back with
`gguf`. The expected names, types and shapes are those llama.cpp's own `convert_hf_to_gguf.py --target-model-dir`
writes for the same head (its eagle3 loader reads exactly these), and the refusals name what llama.cpp cannot run.
No llama.cpp build is needed: benchmarks/vs_llama_cpp.py runs the file in llama-server."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from peagle.cli import main
from peagle.model.checkpoint import random_head, save_head
from peagle.model.drafter import Drafter, DrafterConfig
from peagle.model.target import TargetConfig

VOCAB, WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, DRAFT_VOCAB = 96, 64, 6, 4, 2, 16, 128, 32
TARGET = dict(model_type="llama", vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, eos_token_id=2)
# The metadata llama.cpp's converter writes for an EAGLE-3 head (general.size_label aside, which it only estimates).
EXPECTED_KEYS = {
    "general.architecture", "general.type", "general.name", "general.file_type", "general.quantization_version",
    "eagle3.target_layers", "eagle3.target_hidden_size", "eagle3.norm_before_residual", "eagle3.norm_before_fc",
    "eagle3.block_count", "eagle3.context_length", "eagle3.embedding_length", "eagle3.feed_forward_length",
    "eagle3.attention.head_count", "eagle3.attention.head_count_kv", "eagle3.rope.freq_base",
    "eagle3.attention.layer_norm_rms_epsilon", "eagle3.attention.key_length", "eagle3.attention.value_length",
    "eagle3.vocab_size", "eagle3.rope.dimension_count",
}
TOKENIZER = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.bos_token_id": 1,
             "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False}


def write_target_gguf(path, width: int = WIDTH) -> None:
    """A target GGUF as llama.cpp's converter lays one out, with the metadata the export reads (no real weights)."""
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_block_count(LAYERS)
    w.add_embedding_length(width)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [3 if i < 3 else 1 for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.merges", ["t o", "to k"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def eagle3_head(out, num_layers: int = 1, seed: int = 0):
    """A random one-layer EAGLE-3 head over a draft vocabulary a third of the target's (d2t non-trivial)."""
    target = TargetConfig.from_hf(TARGET)
    config = DrafterConfig.for_target(target, num_layers=num_layers, draft_vocab_size=DRAFT_VOCAB)
    drafter = Drafter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        draft_to_target = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
        drafter.d2t.copy_(draft_to_target - torch.arange(DRAFT_VOCAB))
    save_head(drafter.to(torch.bfloat16), out)
    return drafter


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-cpp-export")
    write_target_gguf(root / "target.gguf")
    drafter = eagle3_head(root / "head")
    out = root / "draft.gguf"
    assert main(["export", str(root / "head"), "--format", "llama.cpp", "--target", str(root / "target.gguf"),
                 "--out", str(out), "--num-speculative-tokens", "4"]) == 0
    return root, drafter.to(torch.bfloat16), gguf.GGUFReader(out)


def test_metadata_is_what_the_eagle3_loader_reads(exported):
    _, drafter, reader = exported
    fields = reader.fields
    keys = {k for k in fields if not k.startswith(("GGUF.", "tokenizer."))}
    assert keys == EXPECTED_KEYS
    assert fields["general.architecture"].contents() == "eagle3"
    layers = fields["eagle3.target_layers"]
    assert layers.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert layers.contents() == [2, LAYERS // 2, LAYERS - 3] == list(drafter.config.feature_layer_ids)
    for key, value in {"target_hidden_size": WIDTH, "block_count": 1, "embedding_length": WIDTH,
                       "feed_forward_length": FFN, "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                       "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM, "vocab_size": VOCAB,
                       "rope.dimension_count": HEAD_DIM, "context_length": 512}.items():
        assert fields[f"eagle3.{key}"].types == [gguf.GGUFValueType.UINT32], key
        assert fields[f"eagle3.{key}"].contents() == value, key
    assert fields["eagle3.norm_before_residual"].contents() is False
    assert fields["eagle3.norm_before_fc"].contents() is False
    assert fields["eagle3.rope.freq_base"].contents() == pytest.approx(10000.0)
    assert fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_BF16)


def test_vocabulary_is_the_targets(exported):
    _, _, reader = exported
    fields = reader.fields
    for key, value in TOKENIZER.items():
        assert fields[key].contents() == value, key
    assert fields["tokenizer.ggml.tokens"].contents() == [f"tok{i}" for i in range(VOCAB)]
    assert fields["tokenizer.ggml.token_type"].types[1] == gguf.GGUFValueType.INT32
    assert fields["tokenizer.ggml.merges"].contents() == ["t o", "to k"]


def _bf16(t: gguf.ReaderTensor) -> torch.Tensor:
    shape = [int(s) for s in reversed(t.shape)]
    return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)


def test_tensors_names_types_shapes_and_values(exported):
    _, drafter, reader = exported
    h, n = WIDTH, HEAD_DIM
    # GGUF shapes list the innermost dimension first, as llama.cpp's create_tensor calls do.
    expected = {
        "fc.weight": ("BF16", [3 * WIDTH, h]), "output.weight": ("BF16", [h, DRAFT_VOCAB]),
        "output_norm.weight": ("F32", [h]), "d2t": ("I64", [DRAFT_VOCAB]),
        "blk.0.attn_norm.weight": ("F32", [h]), "blk.0.attn_norm_2.weight": ("F32", [h]),
        "blk.0.ffn_norm.weight": ("F32", [h]),
        "blk.0.attn_q.weight": ("BF16", [2 * h, HEADS * n]), "blk.0.attn_k.weight": ("BF16", [2 * h, KV_HEADS * n]),
        "blk.0.attn_v.weight": ("BF16", [2 * h, KV_HEADS * n]), "blk.0.attn_output.weight": ("BF16", [HEADS * n, h]),
        "blk.0.ffn_gate.weight": ("BF16", [h, FFN]), "blk.0.ffn_up.weight": ("BF16", [h, FFN]),
        "blk.0.ffn_down.weight": ("BF16", [FFN, h]),
    }  # no token_embd: the head shares the target's, which llama.cpp then borrows
    tensors = {t.name: t for t in reader.tensors}
    assert {name: (t.tensor_type.name, [int(s) for s in t.shape]) for name, t in tensors.items()} == expected
    state = drafter.state_dict()
    assert torch.equal(_bf16(tensors["fc.weight"]), state["fc.weight"])
    assert torch.equal(_bf16(tensors["blk.0.ffn_down.weight"]), state["midlayer.mlp.down_proj.weight"])
    assert torch.equal(torch.from_numpy(np.array(tensors["blk.0.attn_norm_2.weight"].data)),
                       state["midlayer.hidden_norm.weight"].float())
    # q/k rows are in llama.cpp's interleaved-RoPE order: undoing that gives the head's rows back; v is untouched.
    for name, ours, heads in (("attn_q", "q_proj", HEADS), ("attn_k", "k_proj", KV_HEADS)):
        rows = _bf16(tensors[f"blk.0.{name}.weight"])
        unpermuted = rows.reshape(heads, n // 2, 2, -1).transpose(1, 2).reshape(rows.shape)
        assert torch.equal(unpermuted, state[f"midlayer.self_attn.{ours}.weight"]), name
        assert not torch.equal(rows, state[f"midlayer.self_attn.{ours}.weight"]), name
    assert torch.equal(_bf16(tensors["blk.0.attn_v.weight"]), state["midlayer.self_attn.v_proj.weight"])
    # d2t holds absolute target ids (llama.cpp scatters the draft logits to them), peagle's holds offsets.
    d2t = np.array(tensors["d2t"].data)
    assert d2t.tolist() == (torch.arange(DRAFT_VOCAB) + drafter.d2t).tolist()
    assert len(set(d2t.tolist())) == DRAFT_VOCAB and d2t.max() < VOCAB


def test_prints_the_llama_server_line(tmp_path, capsys):
    write_target_gguf(tmp_path / "t.gguf")
    eagle3_head(tmp_path / "head")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "head"), "--format", "llama.cpp", "--target", str(tmp_path / "t.gguf"),
                 "--out", str(tmp_path / "d.gguf"), "--num-speculative-tokens", "5"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == (f"llama-server -m {tmp_path / 't.gguf'} -md {tmp_path / 'd.gguf'} --spec-type draft-eagle3 "
                    "--spec-draft-n-max 5")


def _peagle_head(out):
    target = TargetConfig.from_hf(TARGET)
    save_head(random_head(target, torch.zeros(VOCAB, WIDTH), method="peagle", mask_token_id=3), out)


@pytest.mark.parametrize("case, message", [
    ("peagle", "P-EAGLE"), ("two_layers", "2 decoder layers"), ("missing_head", "no-such-head"),
    ("folder_target", "not a GGUF file"), ("narrow_target", "width"), ("no_target", "--target TARGET.gguf"),
    ("not_gguf_out", "ending in .gguf"), ("random_init", "--random-init writes a head folder"),
])
def test_refusals_name_the_problem(tmp_path, capsys, case, message):
    write_target_gguf(tmp_path / "t.gguf")
    write_target_gguf(tmp_path / "narrow.gguf", width=WIDTH // 2)
    head, target, out = tmp_path / "head", tmp_path / "t.gguf", tmp_path / "d.gguf"
    if case == "peagle":
        _peagle_head(head)
    elif case == "two_layers":
        eagle3_head(head, num_layers=2)
    elif case != "missing_head":
        eagle3_head(head)
    argv = ["export", str(head), "--format", "llama.cpp", "--target", str(target), "--out", str(out)]
    if case == "missing_head":
        argv[1] = str(tmp_path / "no-such-head")
    elif case == "folder_target":
        argv[argv.index(str(target))] = str(head)
    elif case == "narrow_target":
        argv[argv.index(str(target))] = str(tmp_path / "narrow.gguf")
    elif case == "no_target":
        argv.remove("--target")
        argv.remove(str(target))
    elif case == "not_gguf_out":
        argv[-1] = str(tmp_path / "draft")
    elif case == "random_init":
        argv = ["export", "--random-init", "--format", "llama.cpp", "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
