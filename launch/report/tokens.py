"""Token ids -> displayable text pieces, without re-tokenising anything.

Each id's bytes come from the byte-level vocabulary (Qwen's BPE: one unicode stand-in per byte), so
a character split over several tokens (UTF-8 bytes of CJK text, emoji) is shown once, as a piece
covering those tokens. Added tokens (``<|im_start|>``, ``<tool_call>``, ...) are pieces of their own.
Ids are decoded once each and cached.
"""
from __future__ import annotations

from functools import lru_cache
from html import escape
from pathlib import Path

MAX_PENDING_BYTES = 8
"""A piece that is still not valid UTF-8 after this many bytes is shown with replacement marks."""


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> unicode stand-in table (byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def load_tokenizer(model_dir):
    """The checkpoint's ``tokenizer.json`` through the `tokenizers` library (milliseconds), else
    transformers' AutoTokenizer (seconds of imports)."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class Detokenizer:
    """``pieces(ids)`` -> [(start, end, text, is_added)] covering ``ids`` in order, the text
    HTML-escaped; ``tokenizer``: a `tokenizers.Tokenizer` or a transformers tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        if hasattr(tokenizer, "get_added_tokens_decoder"):  # tokenizers.Tokenizer
            self.added = set(int(i) for i in tokenizer.get_added_tokens_decoder())
            self._piece = tokenizer.id_to_token
        else:
            self.added = set(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {})
            self.added |= set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
            self._piece = tokenizer.convert_ids_to_tokens
        self.cache: dict[int, bytes] = {}
        self.html: dict[int, str] = {}
        """id -> its escaped text, for a token that is a whole piece (most are)."""

    def token_id(self, text: str):
        f = getattr(self.tok, "token_to_id", None) or self.tok.convert_tokens_to_ids
        return f(text)

    def token_bytes(self, i: int) -> bytes:
        b = self.cache.get(i)
        if b is None:
            piece = self._piece(int(i))
            dec = byte_decoder()
            if i not in self.added and piece is not None and all(c in dec for c in piece):
                b = bytes(dec[c] for c in piece)
            else:
                b = self.tok.decode([int(i)], skip_special_tokens=False).encode("utf-8")
            self.cache[i] = b
        return b

    def pieces(self, ids) -> list[tuple[int, int, str, bool]]:
        out, buf, start = [], b"", 0
        added, html = self.added, self.html
        for k, i in enumerate(ids):
            i = int(i)
            if not buf:
                t = html.get(i)
                if t is not None:  # a token known to be a whole piece
                    out.append((k, k + 1, t, i in added))
                    start = k + 1
                    continue
            if i in added:
                if buf:
                    out.append((start, k, escape(buf.decode("utf-8", "replace")), False))
                t = html[i] = escape(self.token_bytes(i).decode("utf-8", "replace"))
                out.append((k, k + 1, t, True))
                buf, start = b"", k + 1
                continue
            b = self.token_bytes(i)
            buf += b
            try:
                text = buf.decode("utf-8")
            except UnicodeDecodeError:
                if len(buf) < MAX_PENDING_BYTES:
                    continue
                text = buf.decode("utf-8", "replace")
            t = escape(text)
            if start == k:
                html[i] = t
            out.append((start, k + 1, t, False))
            buf, start = b"", k + 1
        if buf:
            out.append((start, len(ids), escape(buf.decode("utf-8", "replace")), False))
        return out
