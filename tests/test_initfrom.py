"""Initial weights from a file: the strict safetensors reader, name/shape checks against the model, checkpoints, and
the re-warm schedule."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from peerd.config import ConfigError, RunConfig
from trainer.checkpoint import save_checkpoint
from trainer.flat import ParamLayout
from trainer.initfrom import InitError, file_digest, load_init
from trainer.inner import WarmupCosine, make_inner_optimizer, rewarm
from trainer.model import GPT, ModelConfig
from trainer.safetensors import SafetensorsError, load_safetensors, save_safetensors


def tiny(seed: int = 0) -> GPT:
    return GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=8), seed=seed)


def test_safetensors_roundtrip_all_dtypes(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.tensor([True, False]),
        "e": torch.empty(0, 7),
    }
    path = tmp_path / "w.safetensors"
    save_safetensors(path, tensors, metadata={"format": "pt"})
    back = load_safetensors(path)
    assert list(back) == list(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_safetensors(path, {"a": torch.randn(64)})
    data = path.read_bytes()
    for cut in (4, 20, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(SafetensorsError):
            load_safetensors(path)


def test_header_lying_about_sizes_is_refused_before_allocating(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # header length far beyond the file
    with pytest.raises(SafetensorsError, match="header length"):
        load_safetensors(path)
    # a shape that claims 10^12 values backed by 16 bytes
    _write_raw(path, {"a": {"dtype": "F32", "shape": [1000000, 1000000], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(SafetensorsError, match="needs"):
        load_safetensors(path)
    _write_raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 50]}}, bytes(16))
    with pytest.raises(SafetensorsError, match="outside"):
        load_safetensors(path)
    overlap = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
    }
    _write_raw(path, overlap, bytes(16))
    with pytest.raises(SafetensorsError, match="overlap"):
        load_safetensors(path)
    _write_raw(path, {"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, bytes(1))
    with pytest.raises(SafetensorsError, match="dtype"):
        load_safetensors(path)
    path.write_bytes(struct.pack("<Q", 3) + b"[1]")
    with pytest.raises(SafetensorsError, match="not an object"):
        load_safetensors(path)


def test_nan_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    bad = torch.zeros(8)
    bad[3] = math.nan
    save_safetensors(path, {"a": bad})
    with pytest.raises(SafetensorsError, match="NaN"):
        load_safetensors(path)
    bad[3] = math.inf
    save_safetensors(path, {"a": bad.to(torch.float16)})
    with pytest.raises(SafetensorsError, match="NaN or Inf"):
        load_safetensors(path)


def test_init_from_safetensors_sets_exactly_the_files_weights(tmp_path: Path) -> None:
    src = tiny(seed=7)
    path = tmp_path / "w.safetensors"
    save_safetensors(path, {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()})
    model = tiny(seed=0)
    assert load_init(path, model) == len(list(model.parameters()))
    layout = ParamLayout.of(model)
    assert torch.equal(layout.flatten(model), layout.flatten(src).to(torch.bfloat16).float())


def test_init_from_names_the_first_mismatch(tmp_path: Path) -> None:
    state = tiny(seed=1).state_dict()
    path = tmp_path / "w.safetensors"
    wrong = dict(state, **{"head.weight": torch.zeros(3, 16)})
    save_safetensors(path, wrong)
    with pytest.raises(InitError, match=r"'head.weight' has shape \(3, 16\) in the file, \(256, 16\) in the model"):
        load_init(path, tiny())
    save_safetensors(path, {k: v for k, v in state.items() if k != "ln_f.bias"})
    with pytest.raises(InitError, match=r"no 'ln_f\.bias'"):
        load_init(path, tiny())
    save_safetensors(path, dict(state, extra=torch.zeros(1)))
    with pytest.raises(InitError, match="'extra' is not a parameter"):
        load_init(path, tiny())
    save_safetensors(path, dict(state, **{"head.weight": torch.zeros(256, 16, dtype=torch.int32)}))
    with pytest.raises(InitError, match="needs floats"):
        load_init(path, tiny())


def test_init_from_a_peerd_checkpoint_takes_its_global_params(tmp_path: Path) -> None:
    src = tiny(seed=5)
    layout = ParamLayout.of(src)
    glob = layout.flatten(src) + 0.5  # the swarm-agreed weights differ from the local ones in the checkpoint
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"model": src.state_dict(), "global": {"params": glob, "outer_momentum": glob * 0}})
    model = tiny(seed=0)
    load_init(path, model)
    assert torch.equal(layout.flatten(model), glob)
    raw = bytearray(path.read_bytes())
    raw[100] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(InitError, match="checksum"):
        load_init(path, tiny())
    assert len(file_digest(path)) == 64


def test_init_digest_and_rewarm_keys_validate() -> None:
    with pytest.raises(ConfigError, match="init_digest"):
        RunConfig.from_dict({"run": {"init_digest": "abc"}})
    with pytest.raises(ConfigError, match="rewarm_steps"):
        RunConfig.from_dict({"inner": {"rewarm_steps": -1}})
    cfg = RunConfig.from_dict({"inner": {"warmup_steps": 7}})
    assert cfg.rewarm_steps == 7 and "rewarm_steps" not in cfg.spec()["inner"]  # run ids of older runs unchanged
    digest = "ab" * 32
    a, b = RunConfig.from_dict({"run": {"init_digest": digest}}), RunConfig()
    assert a.run_id() != b.run_id()


def test_rewarm_schedule_ramps_from_the_jump() -> None:
    sched = WarmupCosine(warmup_steps=4, total_steps=None)
    assert [sched(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    sched.rewarm_at, sched.rewarm_steps = 10, 5
    assert [sched(s) for s in (9, 10, 11, 14, 15, 30)] == [1.0, 0.2, 0.4, 1.0, 1.0, 1.0]
    sched.rewarm_at = 1  # during the first warmup the lower ramp wins: never slowed twice
    assert sched(1) == pytest.approx(0.2) and sched(3) == pytest.approx(0.6)
    cos = WarmupCosine(warmup_steps=2, total_steps=12, rewarm_at=6, rewarm_steps=4)
    plain = WarmupCosine(warmup_steps=2, total_steps=12)
    assert cos(6) == pytest.approx(plain(6) * 0.25) and cos(12) == pytest.approx(plain(12))


def test_rewarm_resets_moments_and_lr_now_and_survives_a_checkpoint() -> None:
    model = tiny()
    opt, sched = make_inner_optimizer(model, lr=1e-2, weight_decay=0.0, warmup_steps=2, total_steps=None)
    for _ in range(5):
        _, loss = model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    assert opt.state and opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    rewarm(opt, sched, 4)
    assert not opt.state  # fresh AdamW moments
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2.5e-3, 2.5e-3])
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    saved = sched.state_dict()
    _, sched2 = make_inner_optimizer(tiny(), lr=1e-2, weight_decay=0.0, warmup_steps=2, total_steps=None)
    sched2.load_state_dict(saved)
    assert sched2.lr_lambdas[0].rewarm_at == 5 and sched2.lr_lambdas[0](6) == pytest.approx(0.5)


def test_hf_factory_without_the_extra_is_one_line() -> None:
    import importlib.util

    from trainer.plugin import PluginError, build_model

    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed: the missing-extra message cannot show")
    with pytest.raises(PluginError, match=r"needs transformers: pip install 'peerd\[hf\]'"):
        build_model("trainer.hf:causal_lm", {"config": "examples/hf/tiny-llama/config.json"})


def test_a_one_step_jump_rewarms_only_moments_a_checkpoint_kept() -> None:
    """One step ahead is an ordinary round for moments that trained on the step before; for moments a resumed
    checkpoint kept while the swarm trained on, it is not (README, "Re-warmup")."""
    from trainer.inner import rewarm_reason

    assert rewarm_reason(1, "behind", moments_from_checkpoint=False) == ""
    assert (
        rewarm_reason(1, "start", moments_from_checkpoint=True)
        == "1 outer steps ahead of ours (our moments are from a checkpoint)"
    )
    assert rewarm_reason(0, "start", moments_from_checkpoint=True) == ""  # our own step: nothing moved
    assert rewarm_reason(2, "behind", moments_from_checkpoint=False) == "2 outer steps ahead of ours"
    assert rewarm_reason(0, "fork", moments_from_checkpoint=False) == "that diverged from ours"
    assert rewarm_reason(5, "sponsored", moments_from_checkpoint=True) == ""  # its own weights ride on top
