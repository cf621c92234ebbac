"""Token ids to text, incrementally: each step decodes a short window of the newest tokens instead of the whole
output, and gives the text those tokens add once it is whole characters.

The window starts at the last point where the text was complete (the previous window's end) and reaches back over
the tokens decoded with it, so a tokenizer that merges or strips across token boundaries (byte-level BPE's multi-byte
characters, SentencePiece's leading space) decodes the window's new part exactly as it decodes the whole output.
"""
from __future__ import annotations

from functools import cached_property

REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that are not (yet) a whole UTF-8 character


class IncrementalDetokenizer:
    """The text of one growing output. `step(ids)` returns the text added since the previous call; while the newest
    tokens end inside a multi-byte character it returns "" and holds them back, until `final=True` flushes them as
    the full decode would show them (as U+FFFD)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.prefix_offset = 0  # the window starts here: tokens whose text is already out, decoded for context
        self.read_offset = 0  # tokens before this have produced their text
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, ids: list[int], final: bool = False) -> str:
        """New text for `ids` (the whole output so far; earlier entries unchanged since the last call)."""
        if self.tokenizer is None or len(ids) <= self.read_offset:
            return ""
        window = self._decode(ids[self.prefix_offset:])
        if not final and (len(window) <= len(self.prefix_text) or window.endswith(REPLACEMENT)):
            return ""  # nothing yet, or the newest tokens end inside a character
        new = window[len(self.prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        return new


class TokenStrings:
    """Each token's own bytes and text, as OpenAI's logprobs report them (`token`, `bytes`). A byte-level BPE token
    can be part of a character: its bytes are exact, its text shows the missing part as U+FFFD."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    @cached_property
    def _byte_of_char(self) -> dict[str, int] | None:
        """GPT-2's byte-level alphabet (printable bytes stand for themselves, the others for code points from 256
        up, in byte order), when the tokenizer uses it; None otherwise."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ != "ByteLevel":
            return None
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        mapping = {chr(b): b for b in printable}
        extra = 256
        for b in range(256):
            if b not in printable:
                mapping[chr(extra)] = b
                extra += 1
        return mapping

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self.tokenizer is None:  # an engine fed token ids: name tokens as vLLM does then
            return f"token_id:{token_id}", []
        alphabet = self._byte_of_char
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if alphabet is not None else None
        if piece is not None and all(c in alphabet for c in piece):
            raw = bytes(alphabet[c] for c in piece)
            text = raw.decode("utf-8", errors="replace")
        else:  # special tokens, and tokenizers that are not byte-level
            text = self.tokenizer.decode([token_id])
            raw = text.encode("utf-8")
        self._cache[token_id] = hit = (text, list(raw))
        return hit
