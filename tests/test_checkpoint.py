"""Atomic checkpoints: round trip, crash safety, corruption detection."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def sample_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "step": 1000 + seed,
        "loss": 2.5,
        "run": "abc",
        "done": False,
        "params": torch.randn(300, generator=gen),
        "bf16": torch.randn(4, 5, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(10),
        "outer": {"lr": 0.7, "buffers": {None: torch.ones(3), 2: torch.zeros(2)}},
        "history": [1, 2.0, "three", None, (4, 5)],
    }


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device.type == "cpu" and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_round_trip_and_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "run" / "ckpt.pt"  # parent is created
    save_checkpoint(path, sample_state(0))
    assert_same(load_checkpoint(path), sample_state(0))
    save_checkpoint(path, sample_state(1))
    assert_same(load_checkpoint(path), sample_state(1))
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]  # no temp files left


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "nothing.pt") is None


def test_views_are_saved_compactly(tmp_path: Path) -> None:
    big = torch.zeros(1_000_000)
    path = tmp_path / "view.pt"
    save_checkpoint(path, {"fragment": big[10:20]})
    assert path.stat().st_size < 100_000  # not the 4 MB storage behind the view
    assert torch.equal(load_checkpoint(path)["fragment"], torch.zeros(10))  # type: ignore[index]


def test_failing_write_leaves_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, sample_state(0))
    before = path.read_bytes()

    def broken_save(obj: object, f: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, sample_state(1))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert_same(load_checkpoint(path), sample_state(0))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_process_killed_mid_write_leaves_old_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, sample_state(0))
    script = textwrap.dedent(
        f"""
        import os, torch
        from trainer.checkpoint import save_checkpoint
        real_save = torch.save
        def dying_save(obj, f):
            f.write(b"PK\\x03\\x04" + b"x" * 4096)
            f.flush()
            os._exit(9)  # the process dies here: no cleanup, no rename
        torch.save = dying_save
        save_checkpoint({str(path)!r}, {{"step": 2}})
        """
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()
    assert_same(load_checkpoint(path), sample_state(0))
    leftovers = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ckpt.pt.")  # the dead writer's temp file


def test_corruption_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, sample_state(0))
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01  # one bit inside the archive: torch alone would not notice
    cases = {
        "flipped": bytes(flipped),
        "truncated": good[: len(good) // 2],
        "footer-only cut": good[:-1],
        "empty": b"",
        "garbage": b"not a checkpoint at all" * 10,
    }
    for label, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError):
            load_checkpoint(path)
        assert issubclass(CheckpointError, ValueError), label
    plain = tmp_path / "plain.pt"
    torch.save({"step": 1}, plain)  # a torch file without our footer
    with pytest.raises(CheckpointError):
        load_checkpoint(plain)


def test_unsupported_state_is_rejected_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    for state in ({"x": {1, 2}}, {"x": object()}, {(1, 2): 3}, ["not", "a", "dict"]):
        with pytest.raises(CheckpointError):
            save_checkpoint(path, state)  # type: ignore[arg-type]
    assert not path.exists() and list(tmp_path.iterdir()) == []
