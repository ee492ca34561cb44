"""--init-from in real swarms: every peer starts from the file's weights (checkpoint or safetensors), the file's digest
is part of the run id, and a late joiner that downloads a state far ahead re-warms its inner optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peerd.config import RunConfig
from tests.swarm import Swarm, tiny_config
from tests.test_swarm_diloco import assert_identical_globals, global_params
from trainer.checkpoint import save_checkpoint
from trainer.flat import ParamLayout
from trainer.model import GPT, ModelConfig
from trainer.safetensors import save_safetensors

pytestmark = pytest.mark.slow


def _source(seed: int) -> GPT:
    cfg = RunConfig.from_dict({"model": {"preset": "tiny", "seq_len": 32}})
    return GPT(ModelConfig.from_dict({"preset": "tiny", "seq_len": cfg.model.seq_len}), seed=seed)


@pytest.mark.parametrize("kind", ["safetensors", "checkpoint"])
def test_every_peer_starts_from_the_files_weights(tmp_path: Path, kind: str) -> None:
    src = _source(seed=42)
    layout = ParamLayout.of(src)
    if kind == "safetensors":
        path = tmp_path / "init.safetensors"
        save_safetensors(path, src.state_dict())
    else:
        path = tmp_path / "checkpoint.pt"
        flat = layout.flatten(src)
        save_checkpoint(path, {"model": src.state_dict(), "global": {"params": flat, "outer_momentum": flat * 0}})
    # an lr so small that one outer step leaves the weights where they started: the final globals show the start
    cfg = tiny_config(tmp_path, run__outer_steps=1, inner__lr=1e-9, inner__steps=2)
    with Swarm(tmp_path, 2, cfg, extra_args=["--init-from", str(path)]) as swarm:
        swarm.wait_exit(120)
    for p in swarm.peers:
        assert "initial weights" in p.log()
        start = global_params(p.data_dir)["params"]
        assert float((start - layout.flatten(src)).abs().max()) < 1e-6
        assert float((start - layout.flatten(_source(seed=0))).abs().max()) > 1e-2  # not the seed's init
    assert_identical_globals([p.data_dir for p in swarm.peers])


def test_a_peer_without_the_file_is_told_what_to_pass(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run__init_digest="ab" * 32)
    peer = Swarm(tmp_path, 1, cfg).spawn(0, None)
    assert peer.proc.wait(60) == 2
    assert "start with --init-from FILE" in peer.log()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    peer = Swarm(tmp_path, 1, tiny_config(tmp_path)).spawn(1, None, extra=["--init-from", str(bad)])
    assert peer.proc.wait(60) == 2
    assert "not valid JSON" in peer.log() and "Traceback" not in peer.log()


def test_late_joiner_rewarms_its_inner_optimizer(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=40, inner__rewarm_steps=3))
    with swarm:
        swarm.wait_until(lambda: swarm.peers[0].status().outer_step >= 3, 120, "step 3")
        late = swarm.add_peer(bootstrap_index=1)
        swarm.wait_exit(240)
    assert "re-warming the inner optimizer over 3 steps" in late.log()
    assert late.summary()["rewarms"] >= 1
    assert swarm.peers[0].summary()["rewarms"] == 0
    assert torch.equal(global_params(late.data_dir)["params"], global_params(swarm.peers[0].data_dir)["params"])
    assert_identical_globals([p.data_dir for p in swarm.peers])
