"""Token streams for training and evaluation: byte-level text or pre-tokenised uint16 files.

Peers must agree on the data without downloading anything, so the default corpus is the Python standard
library's own sources, which every machine running peerd already has. Token files are memory-mapped
(copy-on-write, never written) so a large corpus costs no RAM up front. Put :meth:`TokenData.fingerprint` in
the run spec so peers with different data (e.g. another Python version's stdlib) do not mix.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

TEXT_SUFFIXES = frozenset({".py", ".txt", ".md", ".rst"})
TOKEN_SUFFIXES = frozenset({".bin", ".u16"})
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
STRIPE_TOKENS = 1 << 16  # shards interleave in stripes of this many tokens (see TokenData.shard_spans)
SPLITS = ("train", "eval")
# Directories under the stdlib path that are not the stdlib (they differ between machines) or are caches.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})


class DataError(ValueError):
    """The data path, its contents or a batch request is unusable."""


def _text_files(root: Path, suffixes: frozenset[str], skip_dirs: frozenset[str]) -> list[Path]:
    """Text files under ``root`` sorted by relative path, so every machine reads them in the same order."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for fname in filenames:
            if Path(fname).suffix in suffixes:
                full = Path(dirpath) / fname
                found.append((full.relative_to(root).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return [full for _, full in found]


def _read_capped(files: list[Path], max_bytes: int | None) -> bytearray:
    """Concatenate the raw bytes of ``files``, stopping exactly at ``max_bytes``."""
    out = bytearray()
    for path in files:
        if max_bytes is not None and len(out) >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable file (permissions, broken link): skip it rather than fail the corpus
        out += data if max_bytes is None else data[: max_bytes - len(out)]
    return out


def _text_buffer(raw: bytearray, vocab_size: int, what: str) -> memoryview:
    if not raw:
        raise DataError(f"no text read from {what}")
    if vocab_size < 256:
        raise DataError(f"byte-level text needs vocab_size >= 256, got {vocab_size}")
    return memoryview(raw)


def _map_u16(path: Path, vocab_size: int) -> memoryview:
    """Memory-map a little-endian uint16 token file and check that every token is below ``vocab_size``."""
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {path} is empty")
    if size % 2:
        raise DataError(f"token file {path} has an odd size ({size} bytes); expected little-endian uint16")
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machines to test on
        raise DataError("uint16 token files are little-endian; this machine is big-endian")
    with path.open("rb") as f:
        # ACCESS_COPY: the writable buffer torch.frombuffer wants; pages are copied only if written (never).
        mapped = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
    tokens = torch.frombuffer(mapped, dtype=torch.uint16)
    chunk = 1 << 22
    for start in range(0, tokens.numel(), chunk):  # uint16 has no max kernel: widen one chunk at a time
        top = int(tokens[start : start + chunk].to(torch.int32).max())
        if top >= vocab_size:
            raise DataError(f"token file {path} holds token {top}, not below vocab_size {vocab_size}")
    return mapped


def _tokenized(
    tokenizer: str | os.PathLike[str], text: memoryview, vocab_size: int, cache_dir: str | os.PathLike[str] | None
) -> memoryview:
    """``text`` through the tokenizer (cached), checked against the model's vocabulary."""
    from trainer.tokenize import TokenizerError, tokenize_text
    from trainer.tokenize import vocab_size as tokenizer_vocab

    try:
        size = tokenizer_vocab(tokenizer)
        if size > vocab_size:
            raise DataError(
                f"data.tokenizer {tokenizer} has {size} tokens, more than the model's vocab_size {vocab_size}"
            )
        ids = tokenize_text(tokenizer, bytes(text), Path(cache_dir) if cache_dir is not None else None)
    except TokenizerError as exc:
        raise DataError(str(exc)) from None
    return memoryview(ids)


class TokenData:
    """One split of a token stream, with sharded random training windows and fixed evaluation batches."""

    def __init__(self, buffer: memoryview, *, dtype: torch.dtype, seq_len: int, split: str, source: str) -> None:
        """Wrap ``buffer`` (the bytes of one split; not copied) as tokens of ``dtype`` (uint8 or uint16)."""
        if dtype not in (torch.uint8, torch.uint16):
            raise DataError(f"token dtype must be torch.uint8 or torch.uint16, got {dtype}")
        itemsize = 1 if dtype == torch.uint8 else 2
        n = len(buffer) // itemsize
        if n < seq_len + 1:
            raise DataError(f"{split} split of {source} has {n} tokens; need at least seq_len + 1 = {seq_len + 1}")
        self._buffer = buffer[: n * itemsize]
        self.tokens = torch.frombuffer(self._buffer, dtype=dtype)
        self.seq_len = seq_len
        self.split = split
        self._shard_starts: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.source = source

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike[str] | None,
        *,
        seq_len: int,
        split: str = "train",
        eval_fraction: float = 0.05,
        vocab_size: int = 256,
        max_bytes: int | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> TokenData:
        """Load ``split`` of the stream at ``path``; the last ``eval_fraction`` of the tokens is "eval".

        ``path`` is a directory of text files (``.py .txt .md .rst``; raw bytes are the tokens), a
        ``*.bin`` or ``*.u16`` little-endian uint16 token file, or None for the stdlib's ``*.py`` sources.
        ``max_bytes`` caps how much text is read (None: all of a directory, 20 MB of the stdlib).
        ``tokenizer``: a tokenizer.json; text is then turned into its uint16 ids (cached in ``cache_dir``, see
        :mod:`trainer.tokenize`) instead of bytes.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"seq_len must be a positive int, got {seq_len!r}")
        if split not in SPLITS:
            raise DataError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0.0 < float(eval_fraction) < 1.0:
            raise DataError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        if not 1 <= vocab_size <= 65536:
            raise DataError(f"vocab_size must be in [1, 65536], got {vocab_size}")
        if max_bytes is not None and max_bytes < 1:
            raise DataError(f"max_bytes must be positive, got {max_bytes}")

        dtype = torch.uint8
        if path is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            source = f"stdlib:{root}"
            files = _text_files(root, frozenset({".py"}), _STDLIB_SKIP)
            raw = _read_capped(files, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)
            buffer = _text_buffer(raw, 256 if tokenizer else vocab_size, source)
        else:
            p = Path(path)
            source = str(p)
            if p.is_dir():
                files = _text_files(p, TEXT_SUFFIXES, frozenset({"__pycache__"}))
                if not files:
                    raise DataError(f"no {sorted(TEXT_SUFFIXES)} files under {p}")
                buffer = _text_buffer(_read_capped(files, max_bytes), 256 if tokenizer else vocab_size, source)
            elif p.is_file() and p.suffix in TOKEN_SUFFIXES:
                if tokenizer:
                    raise DataError(f"data.tokenizer applies to text, but data.path {p} is already a token file")
                buffer, dtype = _map_u16(p, vocab_size), torch.uint16
            elif p.exists():
                raise DataError(f"{p} is neither a text directory nor a {sorted(TOKEN_SUFFIXES)} token file")
            else:
                raise DataError(f"data path {p} does not exist")

        if tokenizer:
            buffer, dtype = _tokenized(tokenizer, buffer, vocab_size, cache_dir), torch.uint16
            source = f"{source} via {tokenizer}"
        itemsize = 1 if dtype == torch.uint8 else 2
        n_tokens = len(buffer) // itemsize
        cut = (n_tokens - int(n_tokens * float(eval_fraction))) * itemsize
        part = buffer[:cut] if split == "train" else buffer[cut:]
        return cls(part, dtype=dtype, seq_len=seq_len, split=split, source=source)

    def __len__(self) -> int:
        return self.tokens.numel()

    def fingerprint(self) -> str:
        """SHA-256 (hex) of this split's tokens: in the run spec, it keeps peers with other data apart."""
        h = hashlib.sha256(f"{self.tokens.dtype}:{self.tokens.numel()}:".encode())
        h.update(self._buffer)
        return h.hexdigest()

    def shard_spans(self, shard: int, num_shards: int) -> list[tuple[int, int]]:
        """[lo, hi) token ranges of ``shard``: every num_shards-th stripe of the stream, disjoint from other shards.

        Striped rather than one contiguous 1/num_shards: a directory read in name order is not shuffled (the stdlib's
        ``encodings/`` code tables fill one sixteenth of it), and a contiguous cut would hand one peer a shard unlike
        the rest of the corpus. Equal stripes of at most ``STRIPE_TOKENS`` tokens give every shard a sample of the
        whole stream.
        """
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise DataError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
        n = len(self)
        # Every shard gets `periods` equal stripes (one shard: the whole stream).
        periods = 1 if num_shards == 1 else max(1, -(-n // (STRIPE_TOKENS * num_shards)))
        stripe = n // (num_shards * periods)
        if stripe <= self.seq_len:
            raise DataError(f"{n // num_shards} tokens per shard are too few for windows of seq_len + 1 = "
                            f"{self.seq_len + 1}; use fewer data.num_shards or more data")  # fmt: skip
        return [(lo, lo + stripe) for lo in range(shard * stripe, n - stripe + 1, stripe * num_shards)]

    def batch(
        self, batch_size: int, *, shard: int, num_shards: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """Random int64 CPU windows [B, T] from this peer's shard; y is x shifted left by one token."""
        if batch_size < 1:
            raise DataError(f"batch_size must be positive, got {batch_size}")
        key = (shard, num_shards)
        if key not in self._shard_starts:  # computed once per shard: stripe offsets and window-start counts
            spans = self.shard_spans(shard, num_shards)
            counts = torch.tensor([hi - lo - self.seq_len for lo, hi in spans], dtype=torch.int64)
            ends = counts.cumsum(0)
            los = torch.tensor([lo for lo, _ in spans], dtype=torch.int64)
            self._shard_starts[key] = (ends, los - (ends - counts))
        ends, offset = self._shard_starts[key]
        # Every valid window start in the shard is equally likely; a window never crosses a stripe's end.
        pick = torch.randint(0, int(ends[-1]), (batch_size,), generator=generator)
        return self._gather(offset[torch.searchsorted(ends, pick, right=True)] + pick)

    def eval_batches(self, batch_size: int, n: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
        """``n`` batches from the whole split, drawn by a generator seeded with ``seed``: equal on peers."""
        if batch_size < 1 or n < 0:
            raise DataError(f"need batch_size >= 1 and n >= 0, got {batch_size}, {n}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed))
        return [self._windows(0, len(self), batch_size, gen) for _ in range(n)]

    def _windows(self, lo: int, hi: int, batch_size: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """``batch_size`` random (x, y) windows lying entirely within tokens[lo:hi]."""
        span = hi - lo - self.seq_len  # number of valid window starts
        if span < 1:
            raise DataError(f"{hi - lo} tokens are too few for windows of seq_len + 1 = {self.seq_len + 1}")
        return self._gather(torch.randint(lo, lo + span, (batch_size,), generator=gen))

    def _gather(self, starts: Tensor) -> tuple[Tensor, Tensor]:
        """The (x, y) windows of seq_len + 1 tokens that begin at ``starts``."""
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
