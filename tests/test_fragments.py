"""Fragments (which parameters sync together, and when) and flat parameter layouts."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from trainer.flat import LayoutError, ParamLayout
from trainer.fragments import due_fragments, fragment_due, fragment_offsets, split_fragments
from trainer.model import GPT, ModelConfig

SIX = ModelConfig(n_layer=6, n_head=2, d_model=16, seq_len=8)


def block_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


@pytest.mark.parametrize("mode", ["strided", "sequential"])
@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4, 6])
def test_every_param_in_exactly_one_fragment(mode: str, num_fragments: int) -> None:
    model = GPT(SIX)
    fragments = split_fragments(model, num_fragments, mode)  # type: ignore[arg-type]
    names = [n for n, _ in model.named_parameters()]
    flat = [n for frag in fragments for n in frag]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    assert len(fragments) == num_fragments and all(fragments)
    assert {"tok_emb.weight", "pos_emb.weight"} <= set(fragments[0])
    assert {"ln_f.weight", "ln_f.bias", "head.weight"} <= set(fragments[-1])
    owner = {}
    for p, frag in enumerate(fragments):
        for name in frag:
            b = block_of(name)
            if b is not None:
                assert owner.setdefault(b, p) == p  # a block is never split across fragments
    if mode == "strided":
        assert owner == {b: b % num_fragments for b in range(SIX.n_layer)}
    else:
        blocks_per = [sorted(b for b, p in owner.items() if p == q) for q in range(num_fragments)]
        assert all(bs == list(range(bs[0], bs[-1] + 1)) for bs in blocks_per)  # contiguous runs
        assert [b for bs in blocks_per for b in bs] == list(range(SIX.n_layer))  # in order
        sizes = [len(bs) for bs in blocks_per]
        assert max(sizes) - min(sizes) <= 1


def test_split_fragments_rejects_bad_counts_and_modes() -> None:
    model = GPT(SIX)
    for bad in (0, -1, SIX.n_layer + 1):
        with pytest.raises(ValueError):
            split_fragments(model, bad)
    with pytest.raises(ValueError):
        split_fragments(model, 2, "random")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        split_fragments(nn.Linear(2, 2), 1)


@pytest.mark.parametrize(("num_fragments", "H"), [(1, 5), (3, 8), (4, 4), (5, 100), (6, 4)])
def test_each_fragment_due_once_per_period_at_its_offset(num_fragments: int, H: int) -> None:
    offsets = fragment_offsets(num_fragments, H)
    assert len(offsets) == num_fragments and offsets[0] == 0
    assert all(0 <= t < H for t in offsets) and offsets == sorted(offsets)
    horizon = 5 * H
    due = {p: [s for s in range(1, horizon + 1) if fragment_due(s, p, offsets, H)] for p in range(num_fragments)}
    for p, steps in due.items():
        assert all((s - offsets[p]) % H == 0 for s in steps)
        assert all(b - a == H for a, b in itertools.pairwise(steps))
        for start in range(1, horizon - H + 2):  # every window of H consecutive steps holds one sync
            assert sum(start <= s < start + H for s in steps) == 1
    for s in range(1, horizon + 1):
        assert due_fragments(s, offsets, H) == [p for p in range(num_fragments) if s in due[p]]


def test_offsets_spread_evenly_and_schedule_edges() -> None:
    assert fragment_offsets(4, 100) == [0, 25, 50, 75]
    assert fragment_offsets(3, 8) == [0, 2, 5]
    assert not fragment_due(0, 0, [0], 10)  # nothing trained yet
    assert fragment_due(10, 0, [0], 10) and fragment_due(20, 0, [0], 10)
    for bad in ((0, 5), (3, 0)):
        with pytest.raises(ValueError):
            fragment_offsets(*bad)
    with pytest.raises(ValueError):
        fragment_due(-1, 0, [0], 10)
    with pytest.raises(ValueError):
        fragment_due(5, 1, [0], 10)


def test_layout_flatten_unflatten_round_trip() -> None:
    src, dst = GPT(SIX, seed=1), GPT(SIX, seed=2)
    layout = ParamLayout.of(src)
    flat = layout.flatten(src)
    assert flat.dtype == torch.float32 and flat.shape == (src.num_params(),) == (layout.numel,)
    layout.unflatten_into(flat, dst)
    for (name, a), (_, b) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    views = layout.unflatten(flat)
    assert torch.equal(views["blocks.2.mlp.fc.weight"], src.blocks[2].mlp.fc.weight)
    assert torch.equal(layout.flatten(dict(src.named_parameters())), flat)
    assert torch.equal(layout.flatten([p for _, p in src.named_parameters()]), flat)
    # Offsets tile the buffer in order.
    spans = layout.slice(layout.names)
    assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] == layout.numel


def test_layout_from_shapes_matches_model() -> None:
    model = GPT(SIX)
    layout = ParamLayout.of(model)
    assert ParamLayout.from_shapes(layout.entries()) == layout
    assert ParamLayout.from_shapes([("a", [2, 3]), ("b", [])]).numel == 7
    assert ParamLayout.from_shapes([("a", [2, 3])], max_numel=6).numel == 6
    with pytest.raises(LayoutError):
        ParamLayout.from_shapes([("a", [1 << 20, 1 << 20])], max_numel=1 << 30)
    with pytest.raises(LayoutError):
        ParamLayout.from_shapes([("a", [2, -3])])
    with pytest.raises(LayoutError):
        ParamLayout.from_shapes([("a", [2]), ("a", [3])])
    with pytest.raises(LayoutError):
        layout.slice(["no.such.param"])


def test_layout_fragment_gather_scatter() -> None:
    model = GPT(SIX)
    layout = ParamLayout.of(model)
    flat = layout.flatten(model)
    frag = split_fragments(model, 3, "strided")[1]
    values = layout.gather(flat, frag)
    assert values.numel() == layout.fragment_numel(frag)
    expected = torch.cat([dict(model.named_parameters())[n].detach().reshape(-1) for n in frag])
    assert torch.equal(values, expected)
    target = torch.zeros_like(flat)
    layout.scatter_(target, frag, values)
    mask = torch.zeros(layout.numel, dtype=torch.bool)
    for off, n in layout.slice(frag):
        mask[off : off + n] = True
    assert torch.equal(target[mask], flat[mask]) and torch.all(target[~mask] == 0)
    with pytest.raises(LayoutError):
        layout.scatter_(target, frag, values[:-1])


def test_layout_casts_into_bf16_params_and_rejects_bad_buffers() -> None:
    model = GPT(SIX)
    layout = ParamLayout.of(model)
    flat = layout.flatten(model)
    half = GPT(SIX, seed=5).to(torch.bfloat16)
    layout.unflatten_into(flat, half)
    assert torch.equal(half.head.weight, model.head.weight.to(torch.bfloat16))
    assert layout.flatten(half).dtype == torch.float32
    with pytest.raises(LayoutError):
        layout.unflatten_into(flat[:-1], model)
    with pytest.raises(LayoutError):
        layout.check(flat.double())
    bad = flat.clone()
    bad[3] = float("nan")
    with pytest.raises(LayoutError):
        layout.check(bad)
    other = GPT(ModelConfig(n_layer=6, n_head=2, d_model=32, seq_len=8))
    with pytest.raises(LayoutError):
        layout.flatten(other)
    assert issubclass(LayoutError, ValueError)
