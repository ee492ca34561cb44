"""A user's own model and data, set in the run config by import path, train in a real peer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.swarm import Swarm, tiny_config

pytestmark = pytest.mark.slow


def test_user_model_and_data_factories_train(tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path,
        run__outer_steps=3,
        model__factory="tests.plugin_example:make_model",
        data__factory="tests.plugin_example:make_data",
        inner__lr=0.1,
    )
    with Swarm(tmp_path, 2, cfg) as swarm:
        swarm.wait_exit(120)
    hist = swarm.peers[0].summary()["history"]
    assert hist[-1]["eval_loss"] < hist[0]["eval_loss"] < 5.6  # far below a uniform guess over 256 bytes


def test_bad_factory_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, model__factory="tests.plugin_example:no_such_thing")
    swarm = Swarm(tmp_path, 1, cfg)
    peer = swarm.spawn(0, None)
    assert peer.proc.wait(60) != 0
    assert "no_such_thing" in peer.log()
