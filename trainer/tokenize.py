"""Text through a local ``tokenizers`` file (tokenizer.json) into uint16 token ids, cached on disk.

A run that sets ``data.tokenizer`` trains on subword ids instead of raw bytes. The tokenizer is a file every peer
holds (its digest is part of the run spec), never a hub download. Tokenizing megabytes of text takes seconds, so
the ids are cached under the peer's data dir, keyed by the digest of the tokenizer and of the text itself: a
restarted peer reuses them, and changed text or another tokenizer can never hit a stale cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import torch

MAX_VOCAB = 1 << 16  # ids are stored as uint16


class TokenizerError(ValueError):
    """The tokenizer file is missing, unusable, too large for uint16 ids, or the package is not installed."""


def load_tokenizer(path: str | os.PathLike[str]):  # -> tokenizers.Tokenizer (optional dependency)
    """Load a tokenizer.json; one clear line when the ``tokenizers`` package or the file is missing."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("data.tokenizer needs the tokenizers package: pip install 'peerd[hf]'") from None
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"data.tokenizer {p} does not exist (give the path of a tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # the Rust side raises plain Exceptions on bad JSON
        raise TokenizerError(f"data.tokenizer {p} is not a tokenizers file: {exc}") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > MAX_VOCAB:
        raise TokenizerError(f"data.tokenizer {p} has {vocab} tokens; ids are stored as uint16, so at most {MAX_VOCAB}")
    return tok


def vocab_size(path: str | os.PathLike[str]) -> int:
    return int(load_tokenizer(path).get_vocab_size(with_added_tokens=True))


def _encode(tok, text: bytes) -> bytearray:
    """uint16 little-endian ids of ``text`` (decoded as UTF-8, bad bytes replaced), in 1 MB pieces cut at newlines
    so the tokenizer never sees one huge string."""
    out = bytearray()
    pieces, start, step = [], 0, 1 << 20
    while start < len(text):
        end = text.rfind(b"\n", start, start + step) + 1 if start + step < len(text) else len(text)
        if end <= start:
            end = min(len(text), start + step)
        pieces.append(text[start:end].decode("utf-8", errors="replace"))
        start = end
    for enc in tok.encode_batch(pieces, add_special_tokens=False):
        ids = torch.tensor(enc.ids, dtype=torch.int32)
        if ids.numel():
            if int(ids.max()) >= MAX_VOCAB or int(ids.min()) < 0:  # pragma: no cover - vocab was checked
                raise TokenizerError("tokenizer produced an id outside uint16")
            chunk = bytearray(ids.numel() * 2)
            torch.frombuffer(chunk, dtype=torch.uint16).copy_(ids.to(torch.uint16))
            out += chunk
    return out


def tokenize_text(tokenizer_path: str | os.PathLike[str], text: bytes, cache_dir: Path | None = None) -> bytearray:
    """Token ids (uint16 LE bytes) of ``text``; read from / written to ``cache_dir`` when given."""
    tok_bytes = Path(tokenizer_path).read_bytes() if Path(tokenizer_path).is_file() else b""
    key = hashlib.sha256(hashlib.sha256(tok_bytes).digest() + hashlib.sha256(text).digest()).hexdigest()[:32]
    cached = Path(cache_dir) / f"tokens-{key}.u16" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        data = bytearray(cached.read_bytes())
        if len(data) % 2 == 0:
            return data
    ids = _encode(load_tokenizer(tokenizer_path), text)
    if cached is not None:
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs time
            cached.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tokens-", dir=cached.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(ids)
            os.replace(tmp, cached)
    return ids
