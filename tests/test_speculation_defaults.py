"""Speculation on by default for every model, resolved once: suffix drafts for a model no head is bundled for, the
hybrid with the bundled heads for the embedded weights in any format (a GGUF re-quantized from them is recognised
by its architecture and vocabulary, not its name), `none` turns it off, and /v1/models, `peagle generate` and the
metrics say what runs. On the serve path the config is resolved once and the engine takes the result as it is."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from peagle.model.heads import DEFAULT_HEADS, HEADS_DIR
from peagle.model.speculation import resolve_speculation
from tests.serve_util import LiveServer, build_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp() / "serve-tiny")


@pytest.fixture(autouse=True)
def no_environment(monkeypatch):
    monkeypatch.delenv("SM_VLLM_SPECULATIVE_CONFIG", raising=False)


def test_a_model_without_a_head_gets_suffix_drafts_under_the_adaptive_policy(tiny_llama, tiny_chat_llama):
    # tiny_chat_llama has SmolLM2's vocabulary but not its shape: not the embedded model either
    for model in (tiny_llama, tiny_chat_llama):
        chosen = resolve_speculation(str(model))
        assert (chosen.method, chosen.origin, chosen.policy) == ("suffix", "default", "adaptive")
        assert chosen.head_path is None and chosen.model_path == model and chosen.note is None
        assert chosen.describe() == f"suffix (adaptive K<={chosen.num_speculative_tokens}), the default"
    off = resolve_speculation(str(tiny_llama), "none")
    assert off.config is None and off.method == "none" and off.describe() == "no speculation, from the flag"


@pytest.fixture(scope="module")
def requantized_gguf(tmp_path_factory):
    """The embedded model's GGUF with every block tensor re-quantized to Q4_0 (what llama-quantize makes of it),
    under a name that says nothing of where it came from."""
    import gguf
    from gguf import GGMLQuantizationType as Q, GGUFValueType

    from peagle.model.loading import embedded_gguf_path

    out = tmp_path_factory.mktemp("requantized") / "model-q4_0.gguf"
    src = gguf.GGUFReader(embedded_gguf_path())
    writer = gguf.GGUFWriter(out, src.fields["general.architecture"].contents())
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in src.tensors:
        if t.tensor_type in (Q.F32, Q.F16):
            writer.add_tensor(t.name, np.array(t.data))
        else:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, gguf.quants.quantize(values, Q.Q4_0), raw_dtype=Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_the_embedded_weights_requantized_get_the_hybrid_with_the_bundled_head(requantized_gguf, tiny):
    from peagle.model.loading import embedded_gguf_path

    assert requantized_gguf.stat().st_size != embedded_gguf_path().stat().st_size  # other blocks, another name
    chosen = resolve_speculation(str(requantized_gguf))
    assert (chosen.method, chosen.origin) == ("hybrid", "default")
    assert chosen.head_path == HEADS_DIR / DEFAULT_HEADS["peagle"] and chosen.config.parallel_drafting
    assert resolve_speculation("smollm2-q4_1").head_path == chosen.head_path  # the package's own Q4_1, by alias
    # a head left unnamed is the bundled one for these weights too
    named = resolve_speculation(str(requantized_gguf), '{"method": "peagle", "num_speculative_tokens": 2}')
    assert named.head_path == chosen.head_path and named.origin == "flag"
    # a model of another shape gets no bundled head for it
    from peagle.config import SpeculativeConfigError

    with pytest.raises(SpeculativeConfigError, match="names no head"):
        resolve_speculation(str(tiny[0]), '{"method": "peagle"}')


def _serve_args(*argv: str) -> argparse.Namespace:
    from peagle.serve import cli

    p = argparse.ArgumentParser()
    cli.add_serve_args(p)
    cli.apply_env_defaults(p, {})
    return p.parse_args(list(argv))


@pytest.mark.parametrize("flag, method", [(None, "suffix"), ("none", "none")])
def test_serve_resolves_once_and_v1_models_says_what_runs(tiny, monkeypatch, flag, method):
    from openai import OpenAI

    from peagle.model import speculation
    from peagle.serve import cli

    calls = []
    resolve = speculation.resolve_speculation
    monkeypatch.setattr(speculation, "resolve_speculation", lambda *a, **kw: calls.append(a) or resolve(*a, **kw))
    args = _serve_args(str(tiny[0]), "--dtype", "float32", "--max-model-len", "256", "--no-baseline",
                       *(["--speculative-config", flag] if flag else []))
    plan = cli.resolve(args)
    app, aengine = cli.build_server(args, plan)
    assert len(calls) == 1  # the engine took the resolved object and resolved nothing again
    assert aengine.engine.spec is plan.speculation.config and aengine.engine.method == method
    with LiveServer(app, aengine) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none")
        card = client.models.list().data[0]
        shown = card.model_extra["speculation"]
        assert shown == plan.speculation.as_dict()
        assert shown["method"] == method and shown["origin"] == ("default" if flag is None else "flag")
        if flag is None:
            assert shown["speculation_policy"] == "adaptive" and shown["what_runs"].startswith("suffix (adaptive K<=")
        else:
            assert card.model_extra["speculative_config"] is None and shown["what_runs"].startswith("no speculation")
        out = client.completions.create(model=card.id, prompt="one two one two one two", max_tokens=8)
        assert out.model_extra["speculative_decoding"]["method"] == method
        metrics = client.with_options(base_url=srv.url).get("/metrics", cast_to=str)
        assert f'method="{method}"' in metrics and "peagle:speculation_info" in metrics


def test_generate_says_what_runs_and_no_speculation_turns_it_off(tiny, capsys):
    from peagle.cli import main

    common = ["generate", "one two one two", "--model", str(tiny[0]), "--max-tokens", "6", "--dtype", "float32",
              "--json"]
    assert main(common) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["method"] == "suffix" and on["speculation_origin"] == "default" and on["what_runs"].startswith("suffix")
    assert main([*common, "--no-speculation"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["method"] == "none" and off["what_runs"] == "no speculation, from the flag"
    assert off["text"] == on["text"]  # greedy: speculation changes nothing in the output


def test_bench_measures_the_default_beside_no_speculation(tiny_chat_llama, tmp_path, one_thread):
    from peagle.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--model", str(tiny_chat_llama), "--offline", "--methods", "baseline,default",
                 "--num-prompts", "2", "--max-tokens", "6", "--concurrency", "1", "--threads", "1", "--no-progress",
                 "--out", str(out)]) == 0
    runs = {r["method"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    default = resolve_speculation(str(tiny_chat_llama))
    assert set(runs) == {"baseline", "default"} and runs["default"]["policy"] == "adaptive"
    assert runs["default"]["k"] == default.num_speculative_tokens
    assert "peagle's default adaptive K<=" in (out / "results.md").read_text()
