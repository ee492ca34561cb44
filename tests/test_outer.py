"""Outer updates: Nesterov (DiLoCo), NoLoCo, Streaming DiLoCo merge."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.outer import NesterovOuter, OuterError, noloco_step, pseudo_gradient, streaming_merge


def randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_nesterov_hand_computed() -> None:
    # lr 0.5, mu 0.5, values exact in binary.
    opt = NesterovOuter(lr=0.5, momentum=0.5)
    params = torch.zeros(2)
    opt.step(params, torch.tensor([1.0, -2.0]))  # v = [1, -2]; update = g + 0.5 v = [1.5, -3]
    assert params.tolist() == [-0.75, 1.5]
    opt.step(params, torch.tensor([0.5, 0.5]))  # v = [1, -0.5]; update = [1, 0.25]
    assert params.tolist() == [-1.25, 1.375]


def test_nesterov_matches_torch_sgd() -> None:
    n = 1000
    ours = randn(n, 0)
    ref = torch.nn.Parameter(ours.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt = NesterovOuter(lr=0.7, momentum=0.9)
    for step in range(6):
        g = randn(n, 100 + step)
        opt.step(ours, g)
        ref.grad = g.clone()
        sgd.step()
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, randn(n, 0))


def test_nesterov_preview_is_the_step_without_taking_it() -> None:
    """DiLoCo's eager guess: bit for bit what `step` would give, with the params and the momentum left untouched."""
    opt = NesterovOuter(lr=0.7, momentum=0.9)
    params = randn(100, 0)
    opt.step(params, randn(100, 1))  # a momentum buffer to preview from
    before, momentum = params.clone(), opt.buffers[None].clone()
    g = randn(100, 2)
    guess = opt.preview(params, g)
    assert torch.equal(params, before) and torch.equal(opt.buffers[None], momentum)
    opt.step(params, g)
    assert torch.equal(guess, params)


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (exact for one +, - or * of float32 inputs)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_nesterov_is_one_rounding_per_op() -> None:
    """Bitwise equal to a pure-Python float32 emulation of the same op sequence (one rounding per op, no FMA)."""
    n = 512
    ours = randn(n, 1)
    ref = ours.tolist()
    v = [0.0] * n
    lr, mu = f32(0.7), f32(0.9)
    opt = NesterovOuter(lr=0.7, momentum=0.9)
    for step in range(4):
        g = randn(n, 200 + step)
        opt.step(ours, g)
        for i, gi in enumerate(g.tolist()):
            v[i] = f32(f32(v[i] * mu) + gi)
            update = f32(f32(f32(v[i] * mu) + gi) * lr)
            ref[i] = f32(ref[i] - update)
    assert ours.tolist() == ref


def test_nesterov_keeps_a_momentum_per_fragment() -> None:
    flat = randn(300, 2)
    separate = [flat[:100].clone(), flat[100:].clone()]
    keyed = NesterovOuter()
    independent = [NesterovOuter(), NesterovOuter()]
    for step in range(3):
        g = randn(300, 300 + step)
        if step != 1:  # fragment 0 skips a round: its momentum must not be touched
            keyed.step(flat[:100], g[:100], key=0)
            independent[0].step(separate[0], g[:100])
        keyed.step(flat[100:], g[100:], key=1)  # in place on a view of the bigger buffer
        independent[1].step(separate[1], g[100:])
    assert torch.equal(flat[:100], separate[0]) and torch.equal(flat[100:], separate[1])
    with pytest.raises(OuterError):
        keyed.step(flat[:50], g[:50], key=0)  # key 0's momentum has 100 values


def test_nesterov_state_round_trip_through_checkpoint(tmp_path: Path) -> None:
    a = NesterovOuter(lr=0.5, momentum=0.8)
    pa = randn(64, 3)
    for step in range(3):
        a.step(pa, randn(64, 400 + step))
        a.step(pa[:8], randn(8, 500 + step), key="frag")
    save_checkpoint(tmp_path / "outer.ckpt", {"outer": a.state_dict()})
    b = NesterovOuter()
    b.load_state_dict(load_checkpoint(tmp_path / "outer.ckpt")["outer"])  # type: ignore[index]
    assert (b.lr, b.momentum) == (0.5, 0.8)
    pb = pa.clone()
    for step in range(2):
        g = randn(64, 600 + step)
        a.step(pa, g)
        b.step(pb, g)
    assert torch.equal(pa, pb)


def test_nesterov_rejects_bad_input() -> None:
    opt = NesterovOuter()
    params = torch.zeros(4)
    with pytest.raises(OuterError):
        opt.step(params, torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    with pytest.raises(OuterError):
        opt.step(params, torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    with pytest.raises(OuterError):
        opt.step(params, torch.zeros(5))
    with pytest.raises(OuterError):
        opt.step(params, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(OuterError):
        opt.step(torch.zeros(2, 2), torch.zeros(2, 2))
    assert torch.equal(params, torch.zeros(4)) and opt.buffers == {}
    for lr, mu in ((0.0, 0.9), (-1.0, 0.9), (0.7, 1.0), (0.7, -0.1)):
        with pytest.raises(ValueError):
            NesterovOuter(lr=lr, momentum=mu)
    with pytest.raises(OuterError):
        opt.load_state_dict({"lr": 0.7, "momentum": 0.9, "buffers": {None: torch.tensor([float("nan")])}})
    with pytest.raises(OuterError):
        opt.load_state_dict({"lr": 0.7})


def test_pseudo_gradient_sign() -> None:
    assert pseudo_gradient(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])).tolist() == [0.5, -1.0]


def test_noloco_two_peer_example() -> None:
    # Peers A and B, worked out by hand. delta = theta - phi (local minus slow).
    phi_a, theta_a = torch.tensor([1.0, 2.0]), torch.tensor([1.5, 1.0])  # delta_a = [0.5, -1.0]
    phi_b, theta_b = torch.tensor([3.0, 0.0]), torch.tensor([2.0, 1.0])  # delta_b = [-1.0, 1.0]
    delta_mean = torch.tensor([-0.25, 0.0])
    phi_mean = torch.tensor([2.0, 1.0])
    assert torch.equal(((theta_a - phi_a) + (theta_b - phi_b)) / 2, delta_mean)

    m_a, m_b = torch.tensor([0.2, -0.4]), torch.zeros(2)
    pa, pb = phi_a.clone(), phi_b.clone()
    noloco_step(pa, m_a, delta_mean, phi_mean, alpha=0.5, beta=0.5, gamma=0.25)
    noloco_step(pb, m_b, delta_mean, phi_mean, alpha=0.5, beta=0.5, gamma=0.25)
    # A: m = 0.5*[0.2,-0.4] + 0.5*[-0.25,0] + 0.25*([2,1]-[1,2]) = [0.225, -0.45]; phi = [1.225, 1.55]
    # B: m = 0 + [-0.125, 0] + 0.25*([2,1]-[3,0]) = [-0.375, 0.25];               phi = [2.625, 0.25]
    torch.testing.assert_close(m_a, torch.tensor([0.225, -0.45]))
    torch.testing.assert_close(pa, torch.tensor([1.225, 1.55]))
    assert m_b.tolist() == [-0.375, 0.25] and pb.tolist() == [2.625, 0.25]

    # Default alpha=0.5, beta=0.7, gamma=0.7 for A:
    # m = [0.1, -0.2] + 0.7*[-0.25, 0] + 0.7*[1, -1] = [0.625, -0.9]; phi = [1.625, 1.1]
    m_a, pa = torch.tensor([0.2, -0.4]), phi_a.clone()
    noloco_step(pa, m_a, delta_mean, phi_mean)
    torch.testing.assert_close(m_a, torch.tensor([0.625, -0.9]))
    torch.testing.assert_close(pa, torch.tensor([1.625, 1.1]))


def test_noloco_rejects_bad_input() -> None:
    phi, m = torch.zeros(3), torch.zeros(3)
    with pytest.raises(OuterError):
        noloco_step(phi, m, torch.tensor([0.0, float("nan"), 0.0]), torch.zeros(3))
    with pytest.raises(OuterError):
        noloco_step(phi, m, torch.zeros(3), torch.zeros(4))
    assert torch.equal(phi, torch.zeros(3)) and torch.equal(m, torch.zeros(3))


def test_streaming_merge() -> None:
    new_global = torch.tensor([3.0, 6.0, -1.0])
    for alpha, expected in ((0.0, [3.0, 6.0, -1.0]), (0.5, [2.0, 4.0, 1.0]), (0.25, [2.5, 5.0, 0.0])):
        local = torch.tensor([1.0, 2.0, 3.0])
        streaming_merge(local, new_global, alpha=alpha)
        assert local.tolist() == expected, alpha
    local = torch.tensor([1.0, 2.0, 3.0])
    streaming_merge(local, new_global, alpha=1.0)
    assert local.tolist() == [1.0, 2.0, 3.0]
    big = randn(10, 4)
    rest = big[4:].clone()
    streaming_merge(big[:4], torch.zeros(4), alpha=0.0)  # a fragment: a view of a larger buffer
    assert torch.equal(big[:4], torch.zeros(4)) and torch.equal(big[4:], rest)
    for bad in (-0.1, 1.5):
        with pytest.raises(OuterError):
            streaming_merge(local, new_global, alpha=bad)
    with pytest.raises(OuterError):
        streaming_merge(local, torch.tensor([0.0, float("inf"), 0.0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_outer_updates_bitwise_equal_on_cpu_and_cuda() -> None:
    n = 1 << 20
    g = [randn(n, 700 + i) for i in range(3)]
    cpu, gpu = randn(n, 5), randn(n, 5).cuda()
    opt_cpu, opt_gpu = NesterovOuter(), NesterovOuter()
    for gi in g:
        opt_cpu.step(cpu, gi)
        opt_gpu.step(gpu, gi.cuda())
    assert torch.equal(cpu, gpu.cpu())
    phi_c, m_c = randn(n, 6), randn(n, 7)
    phi_g, m_g = phi_c.cuda(), m_c.cuda()
    noloco_step(phi_c, m_c, g[0], g[1])
    noloco_step(phi_g, m_g, g[0].cuda(), g[1].cuda())
    assert torch.equal(phi_c, phi_g.cpu()) and torch.equal(m_c, m_g.cpu())
    local_c = randn(n, 8)
    local_g = local_c.cuda()
    streaming_merge(local_c, g[2], alpha=0.3)
    streaming_merge(local_g, g[2].cuda(), alpha=0.3)
    assert torch.equal(local_c, local_g.cpu())
