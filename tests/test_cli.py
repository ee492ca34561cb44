"""The `peerd` command as a user runs it: init, status, demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peerd.config import RunConfig
from tests.swarm import REPO, Swarm, tiny_config


def peerd(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peerd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=dict(os.environ, **(env or {})),
    )


def test_init_writes_a_loadable_config_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    out = peerd("init", str(path))
    assert out.returncode == 0, out.stderr
    assert RunConfig.load(path).run.algorithm == "diloco"
    again = peerd("init", str(path))
    assert again.returncode != 0 and "already exists" in again.stderr


def test_start_with_a_bad_config_says_which_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[inner]\nlr = 'fast'\n")
    out = peerd("start", "--config", str(path), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"))
    assert out.returncode == 2 and "inner.lr" in out.stderr


@pytest.mark.slow
def test_status_text_and_json(tmp_path: Path) -> None:
    with Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=0)) as swarm:
        swarm.wait_until(lambda: swarm.peers[1].status().outer_step >= 1, 120, "a round")
        addr = swarm.peers[1].address
        text = peerd("status", addr, timeout=30)
        assert text.returncode == 0, text.stderr
        assert "run " in text.stdout and "last round" in text.stdout and "included" in text.stdout
        js = json.loads(peerd("status", addr, "--json", timeout=30).stdout)
        assert js["peer_id"] and js["run_id"] and js["outer_step"] >= 1
        assert len(js["alive"]) == 2 and len(js["peers"]) == 2
        assert set(js["last_round"]["included"]) == set(js["alive"])
        assert js["last_round"]["wire_bytes"] > 0 and js["last_round"]["seconds"] > 0
    missing = peerd("status", "127.0.0.1:1", timeout=30)
    assert missing.returncode == 1 and "cannot get status" in missing.stderr


def test_status_and_init_do_not_import_torch(tmp_path: Path) -> None:
    """`peerd status` is what operators and watchdogs poll: importing torch for it cost 1.8 s idle and several seconds
    on a loaded host (a partition test's status polls then took ~30 s for four peers and missed the fault's moment).
    The command paths stay torch-free; torch loads only where training or checkpoints need it."""
    probe = (
        "import sys; from peerd.cli import main; "
        f"main(['init', {str(tmp_path / 'run.toml')!r}]); "
        "main(['status', '127.0.0.1:1', '--timeout', '0.5', '--insecure']); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


def test_each_demo_is_a_run_of_its_own_and_a_workdir_names_the_same_one(tmp_path: Path) -> None:
    """Two demos on one host shared one run id ("peerd-demo"): a demo whose bootstrap peer finished re-dials its
    address, and a peer of another demo that took the freed port would have let it join that other swarm. A demo's
    run name carries a tag of its own; a --workdir keeps one, so a rerun there resumes its checkpoints."""
    import argparse

    from peerd.demo import demo_config, demo_tag

    args = argparse.Namespace(algorithm="diloco", outer_steps=2, preset="tiny", inner_steps=5, codec="fp32", set=[])
    ids = {RunConfig.from_dict(demo_config(args, demo_tag(None))).run_id() for _ in range(3)}
    assert len(ids) == 3
    kept = [RunConfig.from_dict(demo_config(args, demo_tag(str(tmp_path / "w")))).run_id() for _ in range(2)]
    assert kept[0] == kept[1] and kept[0] not in ids
    assert demo_tag(str(tmp_path / "w")) != demo_tag(str(tmp_path / "v"))


@pytest.mark.slow
def test_demo_json_summary(tmp_path: Path) -> None:
    """Also: the demo's temporary directory is gone afterwards, and no progress line shows a 'nan' loss."""
    out = peerd(
        "demo",
        "--peers",
        "2",
        "--outer-steps",
        "3",
        "--inner-steps",
        "10",
        "--json",
        timeout=400,
        env={"TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outer step   3" in out.stdout
    assert "nan" not in out.stdout.lower()
    assert not list(tmp_path.glob("peerd-demo-*")), "the demo left its temporary directory behind"
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "peers",
        "algorithm",
        "outer_steps",
        "loss_first",
        "loss_last",
        "bytes_sent_total",
        "max_param_diff",
        "wire_bytes_total",
        "compute_idle_fraction",
    ):
        assert key in summary, key
    assert summary["peers"] == 2 and summary["algorithm"] == "diloco" and summary["outer_steps"] == 3
    assert summary["ok"] is True and summary["workdir"] is None
    # each step's line counts the rounds up to that step: every step adds a round, and the last line is the total
    wire = [float(m[1]) for m in re.finditer(r"outer step +\d+ \|.*\(wire ([\d.]+) MB\)", out.stdout)]
    assert len(wire) == 3 and wire[0] < wire[1] < wire[2], out.stdout
    assert wire[2] == round(summary["wire_bytes_total"] / 1e6, 2), (wire, summary["wire_bytes_total"])
    # an honest two-peer run on loopback: no round partial, no step solo or sat out
    assert summary["partial_rounds"] == summary["solo_steps"] == summary["steps_sat_out"] == 0, summary
    assert summary["max_param_diff"] == 0.0
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["bytes_sent_total"] > 0


def test_demo_step_lines_count_the_rounds_up_to_their_step_not_later_ones(capsys: pytest.CaptureFixture) -> None:
    """The live byte counters may already hold the next round when a step's line prints (polls are 0.3 s apart, a
    tiny model's step is shorter): the line sums the peers' round summaries up to its step instead."""
    from peerd.demo import _Printer

    printer = _Printer(2, 3)
    round_of = [
        {"step": str(s), "fragment": -1, "included": ["a", "b"], "expected": ["a", "b"], "seconds": 0.1,
         "raw_bytes": "1000000", "wire_bytes": "700000"}
        for s in range(2)
    ]  # fmt: skip
    for peer in (0, 1):  # both finished step 1 and are through the round of step 2: counters hold both rounds
        printer.add(peer, [{"outer_step": 1, "loss": 3.0}], round_of, sent=2_000_000, wire=1_400_000)
    printer.flush()
    printer.add(0, [{"outer_step": 1, "loss": 3.0}, {"outer_step": 2, "loss": 2.0}], round_of, 2_000_000, 1_400_000)
    printer.add(1, [{"outer_step": 1, "loss": 3.0}, {"outer_step": 2, "loss": 2.0}], round_of, 2_000_000, 1_400_000)
    printer.flush()
    lines = [line for line in capsys.readouterr().out.splitlines() if "outer step" in line]
    assert len(lines) == 2, lines
    assert "sent 2.00 MB (wire 1.40 MB)" in lines[0], lines[0]  # step 1: both peers' first round only
    assert "sent 4.00 MB (wire 2.80 MB)" in lines[1], lines[1]


def test_status_names_rounds_by_the_outer_step_they_completed() -> None:
    """A round's summary carries the step it averaged from (N - 1); the peer table, the logs and the demo name outer
    step N. Status printed 'last round step 17' beside 'outer 18', which read as a peer one round behind."""
    from peerd.status import format_status
    from peerd.v1 import peerd_pb2 as pb

    both = ["a" * 32, "b" * 32]
    rounds = [pb.RoundSummary(step=s, fragment=-1, included=both, expected=both) for s in (16, 17)]
    text = format_status(
        pb.StatusResponse(peer_id="a" * 32, outer_step=18, last_round=rounds[-1], recent_rounds=rounds)
    )
    assert "outer 18" in text and "last round, to outer step 18: complete, 2/2 peers" in text, text
    assert "  step 17    with aaaaaaaa bbbbbbbb" in text and "  step 18    with aaaaaaaa bbbbbbbb" in text, text
