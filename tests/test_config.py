"""SpeculativeConfig: vLLM's --speculative-config JSON (and SageMaker's SM_VLLM_SPECULATIVE_CONFIG)."""
from __future__ import annotations

import json

import pytest

from peagle.config import SPECULATIVE_CONFIG_ENV, SpeculativeConfig, SpeculativeConfigError

SAGEMAKER = '{"model": "/opt/ml/additional-model-data-sources/peagle", "method": "eagle3", ' \
            '"num_speculative_tokens": 3, "parallel_drafting": true}'


def test_accepts_the_sagemaker_json():
    c = SpeculativeConfig.parse(SAGEMAKER)
    assert c.model == "/opt/ml/additional-model-data-sources/peagle"
    assert c.method == "eagle3" and c.num_speculative_tokens == 3 and c.parallel_drafting is True
    assert c.drafting == "parallel" and c.method_name == "peagle"
    assert json.loads(c.to_json())["parallel_drafting"] is True
    assert SpeculativeConfig.parse(c.to_json()) == c


def test_defaults_and_dict_input():
    c = SpeculativeConfig.parse({})
    assert c.method == "eagle3" and c.num_speculative_tokens == 3 and not c.parallel_drafting
    assert c.drafting == "chain" and c.method_name == "eagle3"
    c = SpeculativeConfig.parse({"method": "peagle", "num_speculative_tokens": 7})
    assert c.method == "eagle3" and c.parallel_drafting and c.num_speculative_tokens == 7
    for k in (1, 16):
        assert SpeculativeConfig.parse({"num_speculative_tokens": k}).num_speculative_tokens == k
    c = SpeculativeConfig.parse({"draft_tensor_parallel_size": 1, "max_model_len": 2048})
    assert c.max_model_len == 2048


def test_environment_variable(monkeypatch):
    from peagle.model.speculation import resolve_speculation

    def chosen(flag=None):  # a hub id vLLM would fetch: nothing of it is on this disk
        return resolve_speculation("some/other-model", flag, local=False)

    monkeypatch.delenv(SPECULATIVE_CONFIG_ENV, raising=False)
    assert (chosen().method, chosen().origin) == ("suffix", "default")
    monkeypatch.setenv(SPECULATIVE_CONFIG_ENV, SAGEMAKER)
    assert chosen().config.parallel_drafting is True and chosen().origin == "environment"
    assert chosen().head_path is None and chosen().config.model == json.loads(SAGEMAKER)["model"]  # not local
    assert chosen("none").config is None and chosen("none").origin == "flag"  # a flag wins over the environment
    monkeypatch.setenv(SPECULATIVE_CONFIG_ENV, "{bad")
    with pytest.raises(SpeculativeConfigError, match=f"(?s)not valid JSON.*from {SPECULATIVE_CONFIG_ENV}"):
        chosen()


@pytest.mark.parametrize("value, field, words", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens", "between 1 and 16"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens", "between 1 and 16"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens", "between 1 and 16"),
    ({"num_speculative_tokens": "three"}, "num_speculative_tokens", ""),
    ({"nmu_speculative_tokens": 3}, "nmu_speculative_tokens", "unknown field"),
    ({"method": "medusa"}, "method", ""),
    ({"parallel_drafting": "sometimes"}, "parallel_drafting", ""),
    ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size", "one device"),
    ({"max_model_len": 0}, "max_model_len", "positive"),
    ({"quantization": "fp8"}, "quantization", "not a drafter weight format"),
])
def test_invalid_values_name_the_field(value, field, words):
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.parse(json.dumps(value))
    assert field in str(e.value) and words in str(e.value)


def test_unknown_field_lists_the_allowed_ones():
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig.parse({"model": "x", "speculative_tokens": 3})
    assert "speculative_tokens" in str(e.value) and "num_speculative_tokens" in str(e.value)


@pytest.mark.parametrize("text", ['{"model": "x",', "nonsense", "", '{"num_speculative_tokens": 3'])
def test_bad_json(text):
    with pytest.raises(SpeculativeConfigError, match="not valid JSON"):
        SpeculativeConfig.parse(text)


@pytest.mark.parametrize("text", ["[1, 2]", '"eagle3"', "3", "null"])
def test_non_object(text):
    with pytest.raises(SpeculativeConfigError, match="JSON object"):
        SpeculativeConfig.parse(text)


def test_check_head():
    c = SpeculativeConfig.parse(SAGEMAKER)
    c.check_head(True)
    with pytest.raises(SpeculativeConfigError, match="mask_hidden"):
        c.check_head(False, "my-head")
    SpeculativeConfig.parse({"parallel_drafting": False}).check_head(False)
