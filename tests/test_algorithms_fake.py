"""Outer algorithms against the in-memory ports (tests/fakeswarm.py): each step's arithmetic, failure and catch-up
paths checked by hand, in milliseconds. The same algorithms run in real swarms in test_swarm_diloco.py,
test_streaming.py and test_noloco.py."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.algorithm import StepDone
from peerd.config import RunConfig
from peerd.consistency import Claim
from peerd.diloco import DiLoCo
from peerd.noloco import NoLoCo, noloco_update
from peerd.statesync import StateSnapshot
from peerd.streaming import StreamingDiLoCo
from tests.fakeswarm import ME, FakeSwarm, FakeTrainer

LR, MU = 0.7, 0.9


def config(algorithm: str, **sections: dict) -> RunConfig:
    raw: dict = {
        "run": {"algorithm": algorithm, "outer_steps": 0},
        "inner": {"steps": 3},
        "outer": {"lr": LR, "momentum": MU},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return RunConfig.from_dict(raw)


def setup(tmp_path: Path, algorithm: str, swarm: FakeSwarm, **sections: dict) -> FakeTrainer:
    trainer = FakeTrainer(config(algorithm, **sections), swarm, tmp_path)
    cls = {"diloco": DiLoCo, "noloco": NoLoCo, "streaming": StreamingDiLoCo}[algorithm]
    trainer.algorithm = cls(trainer)
    return trainer


def flat(trainer: FakeTrainer) -> torch.Tensor:
    return trainer.layout.flatten(trainer.model).detach().clone()


def nesterov_once(g: torch.Tensor, avg: torch.Tensor) -> torch.Tensor:
    """The first outer step from zero momentum: v = avg; g - lr * (avg + mu * v)."""
    return g - LR * (avg + MU * avg)


# -- DiLoCo ---------------------------------------------------------------------------------------------------------
def test_diloco_averages_pseudo_gradients_and_reports_the_step(tmp_path: Path) -> None:
    swarm = FakeSwarm(others=lambda step, fragment, v: [torch.zeros_like(v)])  # one other peer that did not move
    trainer = setup(tmp_path, "diloco", swarm)
    g0 = flat(trainer)
    assert [trainer.inner_step() for _ in range(2)] == [None, None]
    done = trainer.inner_step()  # H = 3: the outer step
    assert isinstance(done, StepDone) and done.step == 1 and not done.published
    assert done.result.included == [ME, "p1"] and swarm.calls == [(0, -1)]
    pseudo = torch.full_like(g0, -0.03)  # global - local after three steps of +0.01
    want = nesterov_once(g0, pseudo / 2)
    assert torch.allclose(trainer.algorithm.global_params, want, atol=1e-6)
    assert torch.allclose(flat(trainer), want, atol=1e-6)  # local params reset to the new global ones
    assert trainer.algorithm.work == 2 and trainer.outer_step == 1


def test_diloco_failed_round_changes_nothing_and_retries_with_more_progress(tmp_path: Path) -> None:
    swarm = FakeSwarm(fail={(0, -1)})
    trainer = setup(tmp_path, "diloco", swarm)
    g0 = flat(trainer)
    assert [trainer.inner_step() for _ in range(3)] == [None] * 3
    assert torch.equal(trainer.algorithm.global_params, g0) and trainer.algorithm.work == 0
    assert torch.allclose(flat(trainer), g0 + 0.03)  # local progress kept
    done = [trainer.inner_step() for _ in range(3)][-1]
    assert done is not None and done.step == 1 and swarm.calls == [(0, -1), (0, -1)]
    assert torch.allclose(trainer.algorithm.global_params, nesterov_once(g0, torch.full_like(g0, -0.06)), atol=1e-6)


def test_diloco_logs_a_contribution_far_larger_than_its_recent_applied_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The owners' norm screen refuses a contribution 10x theirs: the sender's log says how its size came about."""
    trainer = setup(tmp_path, "diloco", FakeSwarm())
    for _ in range(9):  # three applied rounds of three 0.01 steps
        trainer.inner_step()
    with caplog.at_level("INFO", logger="peerd"):
        for delta in (0.01, 0.01, 0.01):
            trainer.inner_step(delta)
        assert "RMS" not in caplog.text  # the usual size
        for delta in (0.01, 0.01, 0.2):
            trainer.inner_step(delta)
    assert "step 4: our contribution's RMS" in caplog.text and "3 inner steps over 1 windows" in caplog.text
    assert "no optimizer (a fake trainer)" in caplog.text


def test_diloco_behind_the_swarm_discards_its_work_when_asked(tmp_path: Path) -> None:
    swarm = FakeSwarm(behind={(0, -1): 5})
    trainer = setup(tmp_path, "diloco", swarm, outer={"late_work": "discard"})
    served = {
        "params": torch.linspace(-1, 1, trainer.layout.numel),
        "outer_momentum": torch.zeros(trainer.layout.numel),
    }
    swarm.state = StateSnapshot(5, served, work=20)
    done = [trainer.inner_step() for _ in range(3)][-1]
    assert done == StepDone(5) and trainer.adopted == [(5, "behind")]
    assert torch.equal(flat(trainer), served["params"]) and trainer.algorithm.work == 20
    assert trainer.algorithm.discarded_steps == 3 and trainer.algorithm.carried_steps == 0


def test_diloco_overlap_lands_the_round_a_step_later_and_keeps_the_steps_trained_meanwhile(tmp_path: Path) -> None:
    """outer.overlap: the boundary starts the round and returns; the next inner step applies it. The global state is
    the synchronous one; our weights are the new global plus the one step trained while the round ran, and that
    step goes into the next round's pseudo-gradient (nothing is lost)."""
    swarm = FakeSwarm(others=lambda step, fragment, v: [torch.zeros_like(v)])
    trainer = setup(tmp_path, "diloco", swarm, outer={"overlap": True})
    g0 = flat(trainer)
    assert [trainer.inner_step() for _ in range(3)] == [None] * 3  # the round for step 0 is in flight
    assert swarm.calls == [(0, -1)] and trainer.outer_step == 0
    done = trainer.inner_step()
    assert isinstance(done, StepDone) and done.step == 1 and done.result.included == [ME, "p1"]
    sync = setup(tmp_path, "diloco", FakeSwarm(others=lambda step, fragment, v: [torch.zeros_like(v)]))
    [sync.inner_step() for _ in range(3)]
    want = sync.algorithm.global_params
    assert torch.equal(trainer.algorithm.global_params, want)  # bit for bit what the synchronous round gives
    assert torch.allclose(want, nesterov_once(g0, torch.full_like(g0, -0.03) / 2), atol=1e-6)
    assert torch.allclose(flat(trainer), want + 0.01, atol=1e-6)
    assert [trainer.inner_step() for _ in range(2)] == [None, None]  # t = 5: the next boundary
    assert swarm.calls == [(0, -1), (1, -1)]
    assert torch.allclose(swarm.vectors[-1], torch.full_like(g0, -0.03), atol=1e-6)  # steps 4, 5 and 6
    assert swarm.tokens == [300, 300]


def test_diloco_overlap_trains_from_the_eager_guess_and_a_failed_round_takes_it_back(tmp_path: Path) -> None:
    """While the round runs, the next window trains from the outer step our own pseudo-gradient would give (not from
    where our inner steps left us); a round that fails takes that guess back out and keeps the steps since."""
    swarm = FakeSwarm(fail={(0, -1)})
    trainer = setup(tmp_path, "diloco", swarm, outer={"overlap": True})
    g0 = flat(trainer)
    [trainer.inner_step() for _ in range(3)]
    assert torch.allclose(flat(trainer), nesterov_once(g0, torch.full_like(g0, -0.03)), atol=1e-6)
    assert trainer.inner_step() is None  # it lands failed
    assert torch.equal(trainer.algorithm.global_params, g0) and trainer.algorithm.work == 0
    assert torch.allclose(flat(trainer), g0 + 0.04, atol=1e-6)  # four steps of progress, no guess
    [trainer.inner_step() for _ in range(2)]  # t = 5: the next round carries all six steps
    assert torch.allclose(swarm.vectors[-1], torch.full_like(g0, -0.06), atol=1e-6)
    trainer.algorithm.close()  # stopped with that round in flight: the weights keep the work, not the guess
    assert torch.allclose(flat(trainer), g0 + 0.06, atol=1e-6)


def test_diloco_overlap_waits_at_the_next_boundary_and_keeps_the_last_round_synchronous(tmp_path: Path) -> None:
    """A round still running when the next window ends is waited for (idle), applied, and the next round starts on
    the following step. The run's last round lands at its boundary, so the run ends with local = global."""
    swarm = FakeSwarm(others=lambda step, fragment, v: [torch.zeros_like(v)])
    trainer = setup(tmp_path, "diloco", swarm, outer={"overlap": True}, run={"outer_steps": 2})
    release = threading.Event()
    real = swarm.allreduce_async

    def slow(*args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        done = real(*args, **kwargs)

        def finish() -> None:
            release.wait(5)
            fut.set_result(done.result())

        threading.Thread(target=finish, daemon=True).start()
        return fut

    swarm.allreduce_async = slow  # type: ignore[method-assign]
    [trainer.inner_step() for _ in range(5)]
    assert trainer.outer_step == 0  # still in flight
    threading.Timer(0.2, release.set).start()
    done = trainer.inner_step()  # t = 5, the boundary: waits for the round, applies it
    assert done is not None and done.step == 1 and trainer.idle >= 0.15
    assert swarm.calls == [(0, -1)]
    done = trainer.inner_step()  # the owed boundary: the last round, synchronous
    assert done is not None and done.step == 2 and swarm.calls == [(0, -1), (1, -1)]
    assert torch.allclose(swarm.vectors[-1], torch.full_like(swarm.vectors[-1], -0.04), atol=1e-6)
    assert torch.equal(flat(trainer), trainer.algorithm.global_params)


def test_diloco_windowed_overlap_keeps_the_swarm_clock_and_meets_the_median_member(tmp_path: Path) -> None:
    """Overlapped windows (inner.window_s): the next window starts where the last was due, so the overshoot of a
    boundary's last step does not add up; and a round that lands moves the next boundary by how late we joined it
    against the group's median member (the leader's join lags), so peers whose windows drifted apart meet again.
    Before this a peer with a 10% smaller CPU share joined every fixed-step boundary 1.6 s late and was flagged."""
    swarm = FakeSwarm(others=lambda step, fragment, v: [torch.zeros_like(v)] * 2, join_lag_ms=[900, 0, 100])
    trainer = setup(tmp_path, "diloco", swarm, outer={"overlap": True}, inner={"window_s": 100.0})
    alg = trainer.algorithm
    alg.window_start = time.monotonic() - 100.5  # the window was due half a second ago (a long last step)
    due = alg.window_start + 100.0
    assert trainer.inner_step() is None and swarm.calls == [(0, -1)]  # the boundary: the round starts, in flight
    assert alg.window_start == pytest.approx(due)  # not "now": the next window ends 100 s after this one was due
    done = trainer.inner_step()  # it lands: we joined 0.8 s after the median member
    assert isinstance(done, StepDone) and done.step == 1
    assert alg.window_start == pytest.approx(due - 0.8)
    alg.window_start = time.monotonic() - 300.0  # a boundary long overdue: the next window is still 3/4 long
    trainer.inner_step()
    assert alg.window_start == pytest.approx(time.monotonic() - 25.0, abs=0.5)


def test_diloco_late_peer_carries_its_work_into_the_next_round(tmp_path: Path) -> None:
    """The straggler adopts the swarm's state, keeps its pseudo-gradient on top of it, and contributes it in the
    next round with the tokens of every inner step behind it."""
    swarm = FakeSwarm(behind={(0, -1): 5})
    trainer = setup(tmp_path, "diloco", swarm)
    served = {
        "params": torch.linspace(-1, 1, trainer.layout.numel),
        "outer_momentum": torch.zeros(trainer.layout.numel),
    }
    swarm.state = StateSnapshot(5, served, work=20)
    done = [trainer.inner_step() for _ in range(3)][-1]
    assert done == StepDone(5) and trainer.adopted == [(5, "behind")]
    assert torch.allclose(flat(trainer), served["params"] + 0.03)  # its 3 steps of +0.01, kept
    assert trainer.algorithm.carried_steps == 3 and trainer.algorithm.discarded_steps == 0
    [trainer.inner_step() for _ in range(3)]
    assert swarm.calls[-1] == (5, -1)
    assert torch.allclose(swarm.vectors[-1], torch.full((trainer.layout.numel,), -0.06))  # 6 steps of work
    assert swarm.tokens == [300, 600]  # every step's tokens go with it


@pytest.mark.parametrize("overlap", [False, True])
def test_diloco_late_peer_starts_its_next_window_where_the_swarms_started(tmp_path: Path, overlap: bool) -> None:
    """Told `behind` with how long ago the missed round formed (RendezvousResponse.behind_ms), the late peer carries
    its work and starts its next window at that moment, not when its resync ended: so it meets the swarm's next
    round instead of missing it too (then its two-window pile is dropped). Never more than a window back."""
    swarm = FakeSwarm(behind={(0, -1): 1, (1, -1): 2}, behind_since_s=30.0)
    trainer = setup(tmp_path, "diloco", swarm, outer={"overlap": overlap}, inner={"window_s": 100.0})
    alg = trainer.algorithm
    served = {
        "params": torch.linspace(-1, 1, trainer.layout.numel),
        "outer_momentum": torch.zeros(trainer.layout.numel),
    }
    swarm.state = StateSnapshot(1, served, work=20)
    alg.window_start = time.monotonic() - 100.5  # our boundary: the round answers that the swarm is past it
    done = [trainer.inner_step() for _ in range(2 if overlap else 1)][-1]
    assert done == StepDone(1) and alg.carried_steps == (2 if overlap else 1)
    assert alg.window_start == pytest.approx(time.monotonic() - 30.0, abs=0.5)  # the swarm's boundary, not now
    # More than a window ago, and before this machine booted: monotonic time counts from boot, so the boundary is below
    # 0, which read as "unknown" (no alignment) on a daemon started within minutes of boot (CI's fresh machine).
    swarm.behind_since_s = time.monotonic() + 500.0  # the next round is due at once
    swarm.state = StateSnapshot(2, served, work=30)
    trainer.layout.unflatten_into(served["params"], trainer.model)
    alg.window_start = time.monotonic() - 100.5
    [trainer.inner_step() for _ in range(2 if overlap else 1)]
    assert trainer.adopted[-1] == (2, "behind")
    assert alg.window_start == pytest.approx(time.monotonic() - 100.0, abs=0.5)


@pytest.mark.parametrize("overlap", [False, True])
def test_diloco_healed_at_its_boundary_starts_the_next_window_where_the_swarms_started(
    tmp_path: Path, overlap: bool
) -> None:
    """At our boundary gossip shows the swarm a step ahead (first seen 1.5 s ago): we adopt its state, carry our work,
    and start the next window 1.5 s back, not at "now". Seen in CI: a peer late once at the start found the swarm
    ahead at each of its next 15 boundaries, and never joined a round."""
    swarm = FakeSwarm()
    trainer = setup(tmp_path, "diloco", swarm, outer={"overlap": overlap}, inner={"window_s": 100.0})
    alg = trainer.algorithm
    swarm.state = _state(trainer, 1)
    swarm.best = Claim(work=10, step=1, digest=b"d" * 32, peer_id="p1", seen_s=1.5)
    alg.window_start = time.monotonic() - 100.5
    assert trainer.inner_step() is None and trainer.adopted == [(1, "behind")] and swarm.calls == []
    assert alg.carried_steps == 1
    assert alg.window_start == pytest.approx(time.monotonic() - 1.5, abs=0.5)


def _state(trainer: FakeTrainer, step: int) -> StateSnapshot:
    served = {
        "params": torch.linspace(-1, 1, trainer.layout.numel),
        "outer_momentum": torch.zeros(trainer.layout.numel),
    }
    return StateSnapshot(step, served, work=10 * step)


def test_diloco_carries_two_missed_rounds_in_a_row(tmp_path: Path) -> None:
    """A late peer whose state arrived a round late can find the next round done too before it meets the swarm's
    clock (seen in CI: a sponsored peer back in rounds). Both windows of its work are carried into the round after,
    with their tokens, rather than dropped at the second miss."""
    swarm = FakeSwarm(behind={(0, -1): 5})
    trainer = setup(tmp_path, "diloco", swarm)
    swarm.state = _state(trainer, 5)
    assert [trainer.inner_step() for _ in range(3)][-1] == StepDone(5)  # window 1: behind, carried
    swarm.behind[(5, -1)] = 6
    swarm.state = _state(trainer, 6)
    assert [trainer.inner_step() for _ in range(3)][-1] == StepDone(6)  # window 2: behind again, carried again
    assert trainer.algorithm.carried_steps == 3 + 6 and trainer.algorithm.discarded_steps == 0
    done = [trainer.inner_step() for _ in range(3)][-1]  # window 3: the round takes all three windows' work
    assert done is not None and done.step == 7 and swarm.calls[-1] == (6, -1)
    assert torch.allclose(swarm.vectors[-1], torch.full((trainer.layout.numel,), -0.09))
    assert swarm.tokens[-1] == 900


def test_diloco_carries_two_windows_of_work_at_most(tmp_path: Path) -> None:
    """Work that missed two rounds (one failed, one found the swarm ahead) and then finds the swarm ahead again is
    three windows long: it is dropped, not carried into a fourth, as the owners' claim cap would refuse it."""
    swarm = FakeSwarm(fail={(0, -1)})
    trainer = setup(tmp_path, "diloco", swarm)
    assert [trainer.inner_step() for _ in range(3)] == [None] * 3  # window 1: the round failed, work kept
    swarm.behind[(0, -1)] = 5
    swarm.state = _state(trainer, 5)
    assert [trainer.inner_step() for _ in range(3)][-1] == StepDone(5)  # window 2: the swarm is ahead: carried
    assert trainer.algorithm.carried_steps == 6
    swarm.behind[(5, -1)] = 6
    swarm.state = _state(trainer, 6)
    assert [trainer.inner_step() for _ in range(3)][-1] == StepDone(6)  # window 3: ahead again: nine steps dropped
    assert torch.equal(flat(trainer), swarm.state.tensors["params"])
    assert trainer.algorithm.discarded_steps == 9 and trainer.algorithm.carried_steps == 6


# -- NoLoCo ---------------------------------------------------------------------------------------------------------
def test_noloco_without_a_partner_takes_the_solo_step(tmp_path: Path) -> None:
    swarm = FakeSwarm()
    trainer = setup(tmp_path, "noloco", swarm)
    algo = trainer.algorithm
    phi, m = algo.phi.clone(), algo.momentum.clone()
    done = [trainer.inner_step() for _ in range(3)][-1]
    assert done is not None and done.step == 1 and swarm.solo_steps == 1 and len(swarm.recorded) == 1
    contributions = {ME: {"phi": phi - algo.phi_ref, "pair": (phi + 0.03) - phi}}
    noloco_update(phi, m, algo.phi_ref, contributions, ME, alpha=0.5, beta=0.7, gamma=0.7)
    assert torch.allclose(algo.phi, phi, atol=1e-6) and torch.allclose(flat(trainer), phi, atol=1e-6)


@pytest.mark.parametrize("send_ahead", [False, True])
def test_noloco_with_a_partner_pulls_towards_it(tmp_path: Path, send_ahead: bool) -> None:
    sent: list[list[str]] = []

    def partner(step: int, mine: dict) -> dict:
        sent.append(sorted(mine))
        if not send_ahead:  # its phi is phi_ref + 1 (we are still at phi_ref), its delta 0: mix = 0.7 * 1
            return {"p1": {"mix": torch.full_like(mine["mix"], 0.7)}}
        return {"p1": {"phi": mine["phi"] + 1.0, "pair": torch.zeros_like(mine["pair"])}}

    swarm = FakeSwarm(partners=partner)
    trainer = setup(tmp_path, "noloco", swarm, noloco={"send_ahead": send_ahead})
    algo = trainer.algorithm
    phi0 = algo.phi.clone()
    done = [trainer.inner_step() for _ in range(3)][-1]
    assert done is not None and done.result.included == [ME, "p1"] and swarm.solo_steps == 0
    assert sent == [["pair", "phi"] if send_ahead else ["mix"]]  # without send-ahead: one tensor
    # mean delta = 0.015, mean phi - phi = +0.5: m = 0.7*0.015 + 0.7*0.5, phi += m
    assert torch.allclose(algo.phi, phi0 + 0.7 * 0.015 + 0.7 * 0.5, atol=1e-6)


# -- Streaming DiLoCo -----------------------------------------------------------------------------------------------
def test_streaming_runs_its_fragments_on_schedule_and_publishes_each_boundary_once(tmp_path: Path) -> None:
    swarm = FakeSwarm()
    trainer = setup(tmp_path, "streaming", swarm, inner={"steps": 4}, streaming={"fragments": 2, "tau": 1})
    dones = [trainer.inner_step() for _ in range(8)]
    # offsets t_p = p*H//P = 0, 2: fragment 1 syncs after s = 2 and 6 (round steps 0, 1), fragment 0 at s = 4
    assert swarm.calls == [(0, 1), (1, 0), (1, 1), (2, 0)]
    assert [d.step if d else None for d in dones] == [None, None, None, 1, None, None, None, 2]
    assert all(d.published for d in dones if d) and trainer.published == [1, 2]
    assert swarm.noted[0] == (0, [ME])  # members noted as having reached the round's step
    assert trainer.algorithm.work == 3  # rounds of one, applied; the one started at s = 8 applies at s = 9


def test_streaming_outranked_at_a_boundary_downloads_only_then(tmp_path: Path) -> None:
    swarm = FakeSwarm()
    trainer = setup(tmp_path, "streaming", swarm, inner={"steps": 4}, streaming={"fragments": 2, "tau": 1})
    for _ in range(3):
        trainer.inner_step()
    assert trainer.adopted == []
    served = trainer.algorithm.state_tensors()
    served["params"] += 1.0
    swarm.state = StateSnapshot(7, served, work=50)
    swarm.best = Claim(work=50, step=7, digest=b"x", peer_id="p1")
    done = trainer.inner_step()  # s = 4: the boundary
    assert trainer.adopted == [(7, "behind")] and done is not None and done.step == 7
    assert torch.allclose(trainer.algorithm.state.global_params, served["params"])


def test_streaming_after_a_state_load_skips_the_boundarys_rounds_and_tells_the_leader(tmp_path: Path) -> None:
    """A joiner that adopted the state of boundary 2 mid-cycle cannot take part in the rounds the swarm started
    there; it says so, so that as their leader (the lowest id) it does not make the others wait for it."""
    swarm = FakeSwarm()
    trainer = setup(tmp_path, "streaming", swarm, inner={"steps": 4}, streaming={"fragments": 2, "tau": 1})
    for _ in range(3):
        trainer.inner_step()
    trainer.algorithm.load_state_tensors(trainer, trainer.algorithm.state_tensors())
    trainer.outer_step = 2  # what the worker's download sets
    swarm.calls.clear()
    for _ in range(3):
        trainer.inner_step()
    assert swarm.skipped == [(2, [0])]  # fragment 0 syncs at every boundary: its round of step 2 is skipped
    assert swarm.calls == [(2, 1)]  # fragment 1's round of the cycle is joined (s = 10)
    assert trainer.algorithm.needs_resync  # the skipped round's update comes with the next boundary's download


@pytest.mark.parametrize("algorithm", ["diloco", "noloco", "streaming"])
def test_algorithms_never_write_the_trainers_step(tmp_path: Path, algorithm: str) -> None:
    trainer = setup(tmp_path, algorithm, FakeSwarm(), inner={"steps": 4})
    for _ in range(3):
        trainer.algorithm.after_inner_step(trainer, trainer.t)
        trainer.t += 1
    done = trainer.algorithm.after_inner_step(trainer, trainer.t)
    assert done is not None and done.step == 1 and trainer.outer_step == 0  # reported, not written


def test_streaming_auto_tau_follows_measured_round_time(tmp_path: Path) -> None:
    from peerd.fragment_sync import SyncRecord

    trainer = setup(tmp_path, "streaming", FakeSwarm(), inner={"steps": 20}, streaming={"fragments": 2, "tau": "auto"})
    algo = trainer.algorithm
    assert algo.tau_max == 10 and algo.schedule.tau == 10  # nothing measured: the cap (offsets 0 and 10)
    algo.step_timer.seconds = 0.02
    algo._retune(SyncRecord(fragment=0, step=0, s=0, t_start=100.0, t_end=100.1))  # 100 ms: 1.25 * 5 steps
    assert algo.schedule.tau == 7 and algo.stats.tau == 7
    algo._retune(SyncRecord(fragment=1, step=0, s=10, t_start=200.0, t_end=205.0))  # a slow link: capped
    assert algo.schedule.tau == 10
    fixed = setup(tmp_path, "streaming", FakeSwarm(), inner={"steps": 20}, streaming={"fragments": 2, "tau": 3})
    fixed.algorithm.step_timer.seconds = 0.02
    fixed.algorithm._retune(SyncRecord(fragment=0, step=0, s=0, t_start=100.0, t_end=101.0))
    assert fixed.algorithm.schedule.tau == 3  # a fixed tau is left alone


def test_streaming_auto_tau_shrinks_when_rounds_are_fast(tmp_path: Path) -> None:
    swarm = FakeSwarm()
    trainer = setup(tmp_path, "streaming", swarm, inner={"steps": 8}, streaming={"fragments": 2, "tau": "auto"})
    for _ in range(16):
        time.sleep(0.02)  # steps of 20 ms: with microsecond steps, a round preempted by a loaded CPU looked slow
        trainer.inner_step()
    assert 1 <= trainer.algorithm.schedule.tau < trainer.algorithm.tau_max  # in-memory rounds take no time


def test_streaming_counts_the_rounds_it_stops_waiting_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round still in flight when the peer downloads the state, or when it shuts down, is recorded as dropped and
    counted, so that streaming.json accounts for every round started: applied, behind, failed or dropped."""
    import peerd.streaming

    monkeypatch.setattr(peerd.streaming, "_CLOSE_WAIT_S", 0.05)
    swarm = FakeSwarm()
    swarm.allreduce_async = lambda *a, **k: concurrent.futures.Future()  # rounds that never land
    trainer = setup(tmp_path, "streaming", swarm, inner={"steps": 4}, streaming={"fragments": 2, "tau": 1})
    trainer.inner_step()
    trainer.inner_step()  # s = 2: fragment 1's round starts, and stays in flight
    swarm.state = StateSnapshot(3, trainer.algorithm.state_tensors(), work=9)
    assert trainer.resync(-1)
    assert trainer.algorithm.stats.rounds_dropped == 1
    trainer.inner_step()
    trainer.inner_step()  # s = 4 after the download's reposition: the next round starts, and stays in flight
    started = trainer.algorithm.stats.syncs_started
    trainer.algorithm.close()
    stats = trainer.algorithm.stats
    assert started == 2 and stats.rounds_dropped == 2
    assert [r.outcome for r in stats.syncs] == ["dropped", "dropped"]


def test_streaming_error_feedback_carries_what_the_codec_dropped(tmp_path: Path) -> None:
    from peerd.codecs import make_codec

    codec = make_codec("sparse", density=0.25, bits=2, block_size=4)
    swarm = FakeSwarm(codec=codec)
    trainer = setup(
        tmp_path,
        "streaming",
        swarm,
        inner={"steps": 4},
        streaming={"fragments": 2, "tau": 1},
        codec={"name": "sparse", "density": 0.25, "bits": 2, "block_size": 4, "error_feedback": True},
    )
    algo = trainer.algorithm
    for _ in range(3):  # fragment 1 starts at s = 2 and is applied at s = 3
        trainer.inner_step()
    assert algo.stats.syncs[0].fragment == 1 and algo.stats.syncs[0].outcome == "applied"
    sent = swarm.vectors[0]
    residual = algo.feedback.state_dict()["fragment1"]
    assert torch.equal(residual, sent - codec.decode(codec.encode(sent), sent.numel()))  # what the codec dropped
    assert residual.count_nonzero() > 0
    seen = []
    compensate = algo.feedback.compensate
    algo.feedback.compensate = lambda key, x: seen.append((key, x.clone())) or compensate(key, x)
    for _ in range(4):  # its next round (s = 6) sends the new pseudo-gradient plus that residual
        trainer.inner_step()
    assert swarm.calls[2] == (1, 1) and seen[-1][0] == "fragment1"
    assert torch.equal(swarm.vectors[2], seen[-1][1] + residual)


@pytest.mark.parametrize("algorithm", ["diloco", "streaming"])
@pytest.mark.parametrize("against", ["contribution", "average"])
def test_error_feedback_asks_for_the_decoded_contribution_only_when_it_keeps_against_it(
    tmp_path: Path, algorithm: str, against: str
) -> None:
    """Kept against the applied average (the sparse recipe), the residual never reads our decoded contribution, so
    the round must not decode every part of it again for nothing (a vector-sized buffer and a decode per part)."""
    from peerd.codecs import make_codec

    codec = make_codec("sparse", density=0.25, bits=2, block_size=4)
    swarm = FakeSwarm(codec=codec, others=lambda step, fragment, v: [torch.zeros_like(v)])
    sections: dict[str, dict] = {"streaming": {"fragments": 2, "tau": 1}} if algorithm == "streaming" else {}
    codec_keys = {"name": "sparse", "density": 0.25, "bits": 2, "block_size": 4, "error_feedback": True}
    trainer = setup(
        tmp_path, algorithm, swarm, codec={**codec_keys, "feedback_against": against}, inner={"steps": 4}, **sections
    )
    for _ in range(4):
        trainer.inner_step()
    assert swarm.wanted_decoded and swarm.wanted_decoded == [against == "contribution"] * len(swarm.vectors)
    key = "params" if algorithm == "diloco" else "fragment1"
    residual = trainer.algorithm.feedback.state_dict()[key]
    sent = swarm.vectors[0]
    decoded = codec.decode(codec.encode(sent), sent.numel())
    kept = decoded / 2 if against == "average" else decoded  # the applied average: ours and a zero contribution
    assert torch.allclose(residual, sent - kept)


def test_diloco_drops_work_that_no_round_took_for_three_windows(tmp_path: Path) -> None:
    """Rounds that keep failing (or answering "behind" when nobody holds a better state) must not let pending work
    grow without bound (diloco.MAX_PENDING_WINDOWS): four windows long, it would weigh past the owners' claim cap."""
    swarm = FakeSwarm(fail={(0, -1)})
    trainer = setup(tmp_path, "diloco", swarm)
    g0 = flat(trainer)
    assert [trainer.inner_step() for _ in range(3)] == [None] * 3  # window 1: failed, kept
    for _ in range(2):  # windows 2 and 3: failed, kept
        swarm.fail.add((0, -1))
        assert [trainer.inner_step() for _ in range(3)] == [None] * 3
    assert torch.allclose(flat(trainer), g0 + 0.09)
    assert [trainer.inner_step() for _ in range(3)] == [None] * 3  # window 4: too long, dropped, no round
    assert torch.equal(flat(trainer), g0) and trainer.algorithm.discarded_steps == 12
    assert swarm.calls == [(0, -1)] * 3
    done = [trainer.inner_step() for _ in range(3)][-1]  # a fresh window contributes again
    assert done is not None and done.step == 1
    assert torch.allclose(swarm.vectors[-1], torch.full_like(g0, -0.03))


def test_diloco_sponsored_peer_takes_the_outer_step_from_the_round_average(tmp_path: Path) -> None:
    """RoundAverage: a sponsored peer holding state S applies S's round average and ends bit-identical to the
    members (the digest they published); a digest that differs leaves its state, momentum included, untouched."""
    from peerd.statesync import state_digest

    averages: list[torch.Tensor] = []
    swarm = FakeSwarm(others=lambda step, fragment, v: [torch.full_like(v, 0.02 * (step + 1))])
    member = setup(tmp_path / "m", "diloco", swarm)
    member.inner_step()
    member.inner_step()
    assert member.inner_step() is not None  # step 0 -> 1: momentum is non-zero from here on
    before = {k: v.clone() for k, v in member.algorithm.state_tensors().items()}
    work = member.algorithm.work
    orig_allreduce = swarm.allreduce

    def recording(*args: object, **kwargs: object) -> object:
        result = orig_allreduce(*args, **kwargs)
        averages.append(result.average.clone())
        return result

    swarm.allreduce = recording  # type: ignore[method-assign]
    for _ in range(3):
        member.inner_step(0.005)
    assert member.outer_step == 2 and len(averages) == 1
    after = member.algorithm.state_tensors()
    digest = state_digest(2, after, member.algorithm.work)

    peer = setup(tmp_path / "p", "diloco", FakeSwarm())
    peer.adopt(StateSnapshot(1, before, work), "sponsored")
    included = member.algorithm.work - work
    wrong = state_digest(2, after, member.algorithm.work + 1)
    assert not peer.algorithm.apply_average(peer, averages[0], included, wrong)
    held = peer.algorithm.state_tensors()
    assert all(torch.equal(held[k], before[k]) for k in before) and peer.algorithm.work == work
    assert peer.algorithm.apply_average(peer, averages[0], included, digest)
    peer.outer_step = 2
    mine = peer.algorithm.state_tensors()
    assert all(torch.equal(mine[k], after[k]) for k in after) and peer.algorithm.work == member.algorithm.work
