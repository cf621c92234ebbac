"""A model's tokenizer as the engine uses it: the tokenizers library's pipeline and the Jinja chat template, without
importing transformers, whose package reads the source of every model it knows on import (1.5 s of each start).

transformers decides the pipeline (some tokenizer classes rebuild it from the vocabulary rather than take
tokenizer.json as written) and the special tokens, so peagle asks it once per tokenizer and keeps what it resolved
in $PEAGLE_HOME/tokenizers: the pipeline as JSON, the special tokens, whether decoding cleans up spaces and the chat
template. Later starts read that one file. Encoding, decoding and chat rendering equal transformers' own
(tests/test_tokenizer.py compares them on every tokenizer the tests have); training and export keep transformers'.
"""
from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from functools import cached_property
from importlib import metadata
from pathlib import Path

import tokenizers

from peagle.model.home import file_lock, peagle_home

# The files a tokenizer is read from: a change to any of them makes a new record.
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "chat_template.jinja", "chat_template.json", "config.json")
RECORD_VERSION = 1
# The English contractions and punctuation transformers' decode joins to the word before (`clean_up_tokenization`).
_CLEAN_UP = (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), \
    (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")
# Older names of a message's reasoning; templates read `reasoning_content` (and gpt-oss ones `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Encode, decode and render chats for one model: the parts of a transformers tokenizer the engine calls."""

    def __init__(self, record: dict):
        self.backend_tokenizer = tokenizers.Tokenizer.from_str(record["pipeline"])
        # transformers turns off a tokenizer.json's truncation and padding unless a call asks for them
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.special_tokens_map: dict = record["special_tokens_map"]
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (record[k] for k in
                                                                   ("bos_token_id", "eos_token_id", "pad_token_id"))
        self.clean_up_spaces: bool = record["clean_up_spaces"]
        self.chat_template: str | None = record["chat_template"]

    @classmethod
    def load(cls, folder: Path):
        """The tokenizer in a model folder, from its record (made through transformers on first use). A tokenizer
        the tokenizers library cannot run (transformers' SentencePiece backend) is transformers' own."""
        folder = Path(folder).resolve()
        path = record_path(folder)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(path.parent / ".lock"):
                if not path.exists():
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(resolve_with_transformers(folder)))
                    os.replace(tmp, path)
        record = json.loads(path.read_text())
        if record["pipeline"] is None:
            from peagle.model.loading import load_tokenizer

            return load_tokenizer(folder)
        return cls(record)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids),
                                             skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = False,
                            **kwargs) -> str | list[int]:
        """The chat as the model's template renders it, with the variables transformers gives a template: the
        special tokens by name, `add_generation_prompt`, and any keyword (`tools`, `documents`, template flags)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        chat = [_template_message(m) for m in messages]
        variables = {**self.special_tokens_map, "tools": None, "documents": None, **kwargs}
        text = self._template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self):
        return chat_template_environment().from_string(self.chat_template)


def record_path(folder: Path) -> Path:
    """Where a folder's tokenizer record lies: named by the folder, its tokenizer files' sizes and times, and the
    versions of the libraries that resolved it."""
    key = [str(folder), RECORD_VERSION, metadata.version("transformers"), tokenizers.__version__]
    for name in SOURCE_FILES:
        if (folder / name).exists():
            st = (folder / name).stat()
            key += [name, st.st_size, st.st_mtime_ns]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]
    return peagle_home() / "tokenizers" / f"{folder.name}-{digest}.json"


def resolve_with_transformers(folder: Path) -> dict:
    """What transformers makes of the folder's tokenizer, as a record `Tokenizer` loads (no pipeline: it has none)."""
    from peagle.model.loading import load_tokenizer

    tok = load_tokenizer(folder)
    if not hasattr(tok, "backend_tokenizer"):
        return {"pipeline": None}
    # transformers skips its space clean-up for BPE models unless told that corrupting the text is wanted
    clean_up = bool(tok.clean_up_tokenization_spaces) and (
        type(tok.backend_tokenizer.model).__name__ != "BPE"
        or getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return {"pipeline": tok.backend_tokenizer.to_str(), "special_tokens_map": dict(tok.special_tokens_map),
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "clean_up_spaces": clean_up, "chat_template": template}


def _template_message(message: dict) -> dict:
    """A message as templates see it: keys whose value is None left out (many templates print "None" or fail on
    them, and handle a missing key), and its reasoning under every name templates read."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def chat_template_environment():
    """A sandboxed Jinja environment with what chat templates written for transformers use: blocks that trim their
    newlines and leading spaces, `break`/`continue`, a `tojson` that keeps non-ASCII text, `raise_exception`,
    `strftime_now`, namespaces that refuse underscored names (a way to Python's internals), and the
    `{% generation %}` tag (rendered as its body)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; here, its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # no named `self`: a template may pass namespace(self=...)
            for name in dict(*args[1:], **kwargs):
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(*args, **kwargs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env
