"""Facts shared by several commands agree everywhere they show up (docs/design.md, "Defaults and their owners"):
the embedded preset's K, the mask token, the embedded model's hub id and the untrained-head marker."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from peagle.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from peagle.model.heads import DEFAULT_HEADS, HEADS_DIR, embedded_speculative_config
from peagle.model.speculation import resolve_speculation


def _serve_plan(*argv: str):
    from peagle.serve import cli

    p = argparse.ArgumentParser()
    cli.add_serve_args(p)
    cli.apply_env_defaults(p, {})
    return cli.resolve(p.parse_args(list(argv)))


@pytest.mark.parametrize("name", [None, "smollm2", "smollm2-135m", "default", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_embedded_preset_k_agrees_everywhere(name, capsys):
    from peagle.cli import main
    from peagle.serve import catalog, endpoints

    expected = embedded_speculative_config().model_dump(exclude_none=True)
    assert expected["num_speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS
    assert SpeculativeConfig().num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    # what every command runs for the embedded model with no config, its head found in the package
    bundled = str(HEADS_DIR / expected["model"])
    assert resolve_speculation(None).config.model_dump(exclude_none=True) == {**expected, "model": bundled}
    # what `peagle serve NAME` would run
    served = _serve_plan(*([name] if name else [])).speculation.config.model_dump(exclude_none=True)
    assert served == {**expected, "model": bundled}
    # what `peagle models` lists for the preset, as a table and as JSON
    preset = catalog.find(name or "default")
    assert preset.name == catalog.EMBEDDED_PRESET and preset.speculative_config == \
        embedded_speculative_config().to_dict()
    assert main(["models"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("smollm2-135m "))
    assert str(DEFAULT_NUM_SPECULATIVE_TOKENS) in row and DEFAULT_HEADS["peagle"] in row
    assert main(["models", "--json"]) == 0
    listed = next(p for p in json.loads(capsys.readouterr().out) if p["name"] == catalog.EMBEDDED_PRESET)
    assert listed["speculative_config"]["num_speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS
    # what `peagle deploy NAME` / `peagle endpoints` show for it
    assert endpoints._spec_from_args(name or "smollm2", [])["num_speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS


def test_export_and_speculators_config_use_the_default_k(tmp_path):
    from peagle.model.checkpoint import speculators_config
    from peagle.model.export import vllm_serve_line

    raw = json.loads((HEADS_DIR / DEFAULT_HEADS["peagle"] / "config.json").read_text())
    spec = speculators_config(raw, "some/target", method="peagle")
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS
    line = vllm_serve_line("some/target", tmp_path, DEFAULT_NUM_SPECULATIVE_TOKENS, parallel=True)
    assert f'"num_speculative_tokens": {DEFAULT_NUM_SPECULATIVE_TOKENS}' in line


def test_mask_token_rule_matches_the_bundled_head(smollm2_dir):
    from transformers import AutoTokenizer

    from peagle.model.mask_token import choose_mask_token_id

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    head = json.loads((HEADS_DIR / DEFAULT_HEADS["peagle"] / "config.json").read_text())
    chosen = choose_mask_token_id(tok, head["vocab_size"])
    assert chosen == head["mask_token_id"] == 3  # <repo_name>: chat never produces it
    # a special token that occurs in the data is not free: the next one is taken
    counts = torch.zeros(head["vocab_size"], dtype=torch.long)
    counts[3] = 1
    assert choose_mask_token_id(tok, head["vocab_size"], counts) == 4
    # an embedding row past the tokenizer's vocabulary is free when every special token is in use
    counts[: len(tok)] = 1
    assert choose_mask_token_id(tok, len(tok) + 64, counts) == len(tok)


def test_mask_token_without_a_tokenizer_never_guesses_a_used_id():
    from peagle.model.mask_token import choose_mask_token_id

    counts = torch.ones(10, dtype=torch.long)
    counts[6] = 0
    assert choose_mask_token_id(None, 10, counts) == 6  # the highest id the data never uses, not vocab - 1
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token_id(None, 10, torch.ones(10, dtype=torch.long))
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token_id(None, 10)


def test_embedded_hub_id_has_one_owner():
    from peagle.model import export, loading
    from peagle.serve import catalog

    assert loading.EMBEDDED_HUB_ID.endswith("/" + loading.EMBEDDED_MODEL)
    assert loading.is_embedded(loading.EMBEDDED_HUB_ID) and loading.is_embedded(loading.EMBEDDED_MODEL)
    assert export._target_name(None) == loading.EMBEDDED_HUB_ID
    assert catalog.find(loading.EMBEDDED_HUB_ID).name == catalog.EMBEDDED_PRESET


def test_untrained_marker_is_written_and_read_by_one_key(tmp_path, tiny_llama):
    from peagle.model.checkpoint import random_head, save_head
    from peagle.model.heads import UNTRAINED_KEY, is_untrained
    from peagle.model.target import TargetModel

    target = TargetModel.from_pretrained(tiny_llama, dtype=torch.float32)
    head = random_head(target.config, target.embed_tokens.weight, method="peagle", mask_token_id=5)
    save_head(head, tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())[UNTRAINED_KEY] is True
    assert is_untrained(tmp_path / "head")
    assert not any(is_untrained(HEADS_DIR / name) for name in DEFAULT_HEADS.values())
    assert not is_untrained(tmp_path / "missing")
