"""Token data: text directories, uint16 token files, the default stdlib corpus, shards and eval batches."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import pytest
import torch

from trainer.data import STRIPE_TOKENS, DataError, TokenData


def write_u16(path: Path, tokens: list[int]) -> Path:
    path.write_bytes(struct.pack(f"<{len(tokens)}H", *tokens))
    return path


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "b_sub" / "deeper").mkdir(parents=True)
    (root / "__pycache__").mkdir()
    (root / "z.py").write_bytes(b"print('z')\n" * 20)
    (root / "a.txt").write_bytes(b"alpha text\n" * 20)
    (root / "b_sub" / "notes.md").write_bytes(b"# notes\n" * 20)
    (root / "b_sub" / "deeper" / "doc.rst").write_bytes("caf\u00e9 rst\n".encode() * 20)
    (root / "ignored.json").write_bytes(b'{"not": "read"}' * 50)
    (root / "__pycache__" / "cached.py").write_bytes(b"never read\n" * 50)
    return root


def full_stream(data_dir: Path) -> bytes:
    train = TokenData.from_path(data_dir, seq_len=8, split="train")
    evals = TokenData.from_path(data_dir, seq_len=8, split="eval")
    return bytes(torch.cat([train.tokens, evals.tokens]).tolist())


def test_text_dir_reads_sorted_text_files_as_bytes(text_dir: Path) -> None:
    expected = (
        (text_dir / "a.txt").read_bytes()
        + (text_dir / "b_sub" / "deeper" / "doc.rst").read_bytes()
        + (text_dir / "b_sub" / "notes.md").read_bytes()
        + (text_dir / "z.py").read_bytes()
    )
    assert full_stream(text_dir) == expected
    train = TokenData.from_path(text_dir, seq_len=8, split="train", eval_fraction=0.1)
    evals = TokenData.from_path(text_dir, seq_len=8, split="eval", eval_fraction=0.1)
    assert len(evals) == int(len(expected) * 0.1) and len(train) + len(evals) == len(expected)
    assert bytes(evals.tokens.tolist()) == expected[len(train) :]  # eval is the tail of the stream
    x, y = train.batch(4, shard=0, num_shards=1, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        assert bytes([*row_x, row_y[-1]]) in expected


def test_max_bytes_caps_text(text_dir: Path) -> None:
    data = TokenData.from_path(text_dir, seq_len=8, eval_fraction=0.5, max_bytes=100)
    assert len(data) == 50
    assert bytes(data.tokens.tolist()) == (text_dir / "a.txt").read_bytes()[:50]


def test_uint16_token_file(tmp_path: Path) -> None:
    tokens = [(7 * i) % 1000 for i in range(5000)]
    path = write_u16(tmp_path / "tokens.bin", tokens)
    train = TokenData.from_path(path, seq_len=16, vocab_size=1000, eval_fraction=0.2)
    evals = TokenData.from_path(path, seq_len=16, vocab_size=1000, split="eval", eval_fraction=0.2)
    assert train.tokens.dtype == torch.uint16
    assert train.tokens.to(torch.int64).tolist() == tokens[:4000]
    assert evals.tokens.to(torch.int64).tolist() == tokens[4000:]
    x, y = train.batch(8, shard=0, num_shards=1, generator=torch.Generator().manual_seed(1))
    assert x.max() < 1000 and torch.equal(x[:, 1:], y[:, :-1])
    for row in x.tolist():  # every window is a real run of the file: consecutive tokens step by 7 (mod 1000)
        assert all((b - a) % 1000 == 7 for a, b in itertools.pairwise(row))
    same = write_u16(tmp_path / "tokens.u16", tokens)
    again = TokenData.from_path(same, seq_len=16, vocab_size=1000, eval_fraction=0.2)
    assert again.fingerprint() == train.fingerprint() != evals.fingerprint()


def test_uint16_file_rejects_bad_contents(tmp_path: Path) -> None:
    big = write_u16(tmp_path / "big.bin", [1, 2, 3, 256] * 100)
    with pytest.raises(DataError, match="256"):
        TokenData.from_path(big, seq_len=8)  # default vocab 256
    assert len(TokenData.from_path(big, seq_len=8, vocab_size=257)) > 0
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * 50 + b"\x01")
    with pytest.raises(DataError, match="odd size"):
        TokenData.from_path(odd, seq_len=8)
    empty = tmp_path / "empty.u16"
    empty.write_bytes(b"")
    with pytest.raises(DataError):
        TokenData.from_path(empty, seq_len=8)


def test_default_stdlib_data() -> None:
    train = TokenData.from_path(None, seq_len=64)
    evals = TokenData.from_path(None, seq_len=64, split="eval")
    assert train.source.startswith("stdlib:")
    assert 1_000_000 < len(train) + len(evals) <= 20 * 1024 * 1024
    assert len(evals) == int((len(train) + len(evals)) * 0.05)
    text = bytes(train.tokens[:200_000].tolist())
    assert b"def " in text and b"import " in text
    again = TokenData.from_path(None, seq_len=64)
    assert again.fingerprint() == train.fingerprint() != evals.fingerprint()


def test_shards_are_disjoint_and_inside_their_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 3000
    path = write_u16(tmp_path / "positions.bin", list(range(n)))  # token value == position
    data = TokenData.from_path(path, seq_len=10, vocab_size=n, eval_fraction=0.1)
    assert [data.shard_spans(s, 3) for s in range(3)] == [[(0, 900)], [(900, 1800)], [(1800, 2700)]]
    monkeypatch.setattr("trainer.data.STRIPE_TOKENS", 300)  # three stripes per shard
    num_shards = 3
    seen: list[set[int]] = []
    for shard in range(num_shards):
        spans = data.shard_spans(shard, num_shards)
        assert spans == [(shard * 300 + k * 900, shard * 300 + k * 900 + 300) for k in range(3)]
        gen = torch.Generator().manual_seed(shard)
        used: set[int] = set()
        for _ in range(20):
            x, y = data.batch(8, shard=shard, num_shards=num_shards, generator=gen)
            for row in torch.cat([x, y[:, -1:]], dim=1).tolist():  # each window lies inside one stripe
                assert any(lo <= row[0] and row[-1] < hi for lo, hi in spans), row
            used |= set(torch.cat([x, y]).unique().tolist())
        seen.append(used)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


def test_shards_interleave_in_stripes_across_the_whole_stream(tmp_path: Path) -> None:
    """A stream sorted by file name is not shuffled: every shard samples all of it, in equal stripes."""
    n = 4 * STRIPE_TOKENS * 2 + 1000  # more than two stripes' worth per shard
    path = write_u16(tmp_path / "stripes.bin", [i * 3 // n for i in range(n)])  # token == which third
    data = TokenData.from_path(path, seq_len=16, vocab_size=3, eval_fraction=0.001)
    spans = [data.shard_spans(s, 4) for s in range(4)]
    assert len({len(s) for s in spans}) == 1 and len(spans[0]) == 3
    assert len({hi - lo for s in spans for lo, hi in s}) == 1  # equal stripes
    flat = sorted(x for s in spans for x in s)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(flat))  # disjoint
    gen = torch.Generator().manual_seed(0)
    for shard in range(4):
        x, _ = data.batch(2000, shard=shard, num_shards=4, generator=gen)
        assert set(x[:, 0].tolist()) == {0, 1, 2}  # every third of the stream, not one


def test_batches_follow_the_generator(text_dir: Path) -> None:
    data = TokenData.from_path(text_dir, seq_len=8)
    a = data.batch(4, shard=0, num_shards=2, generator=torch.Generator().manual_seed(5))
    b = data.batch(4, shard=0, num_shards=2, generator=torch.Generator().manual_seed(5))
    c = data.batch(4, shard=0, num_shards=2, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_eval_batches_are_deterministic(text_dir: Path) -> None:
    first = TokenData.from_path(text_dir, seq_len=8, split="eval", eval_fraction=0.3).eval_batches(4, 3, seed=7)
    second = TokenData.from_path(text_dir, seq_len=8, split="eval", eval_fraction=0.3).eval_batches(4, 3, seed=7)
    other = TokenData.from_path(text_dir, seq_len=8, split="eval", eval_fraction=0.3).eval_batches(4, 3, seed=8)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))


def test_bad_inputs_raise(tmp_path: Path, text_dir: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        TokenData.from_path(tmp_path / "missing", seq_len=8)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError):
        TokenData.from_path(tmp_path / "empty_dir", seq_len=8)
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError):
        TokenData.from_path(blank, seq_len=8)
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_bytes(b"x" * 40)
    with pytest.raises(DataError, match="seq_len"):
        TokenData.from_path(small, seq_len=64)
    with pytest.raises(DataError):
        TokenData.from_path(text_dir / "ignored.json", seq_len=8)
    with pytest.raises(DataError):
        TokenData.from_path(text_dir, seq_len=8, split="test")
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(DataError):
            TokenData.from_path(text_dir, seq_len=8, eval_fraction=fraction)
    with pytest.raises(DataError):
        TokenData.from_path(text_dir, seq_len=0)
    data = TokenData.from_path(text_dir, seq_len=8)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(DataError):
        data.batch(4, shard=2, num_shards=2, generator=gen)
    with pytest.raises(DataError):
        data.batch(0, shard=0, num_shards=1, generator=gen)
    with pytest.raises(DataError, match="too few"):
        data.batch(1, shard=0, num_shards=len(data) // 4, generator=gen)  # shards shorter than a window
    assert issubclass(DataError, ValueError)
