"""The sparse codec (top-k per block, 2-8 bit values): what it keeps, what it drops into error feedback, what it
costs on the wire, how it refuses hostile frames, its config keys, and a real DiLoCo swarm that uses it."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch

from peerd.codecs import (
    ALL_CODEC_NAMES,
    CODEC_IDS,
    HEADER_SIZE,
    MAX_NUMEL,
    TRAILER_SIZE,
    CodecError,
    ErrorFeedback,
    make_codec,
    parse_header,
)
from peerd.codecs.feedback import FEEDBACK_AGAINST
from peerd.codecs.sparse import BITS_CHOICES, DEFAULT_BITS, DEFAULT_DENSITY, GROUP, MAX_SPARSE_BLOCK, SparseCodec
from peerd.config import FEEDBACK_AGAINST as CONFIG_FEEDBACK_AGAINST
from peerd.config import SPARSE_BITS, SPARSE_MAX_BLOCK, CodecSection, ConfigError, RunConfig, sparse_recipe
from tests.test_codec_corruption import reseal, with_fields

N = 1000


def sparse(**kw: object) -> SparseCodec:
    codec = make_codec("sparse", **kw)  # type: ignore[arg-type]
    assert isinstance(codec, SparseCodec)
    return codec


def sample(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def top_k_mask(x: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Reference: which positions a per-block top-k by magnitude keeps (slow and obvious)."""
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    for start in range(0, x.numel(), block):
        part = x[start : start + block].abs()
        mask[start + part.topk(min(k, part.numel())).indices] = True
    return mask


def body(frame: bytes) -> bytearray:
    return bytearray(frame[HEADER_SIZE : len(frame) - TRAILER_SIZE])


def with_body(frame: bytes, new_body: bytes | bytearray) -> bytes:
    return reseal(frame[:HEADER_SIZE] + bytes(new_body) + b"\0" * TRAILER_SIZE)


# -- what is kept -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS_CHOICES)
@pytest.mark.parametrize("n", [1, 5, 255, 256, 257, 1000, 4096])
def test_keeps_the_top_k_of_every_block_within_half_a_step(bits: int, n: int) -> None:
    codec = sparse(bits=bits, zstd=False)
    x = sample(n, seed=n)
    y = codec.decode(codec.encode(x), n)
    kept = y != 0
    assert torch.equal(kept, top_k_mask(x, 256, codec.k))  # distinct magnitudes: the kept set is unique
    assert torch.equal(torch.sign(y[kept]), torch.sign(x[kept]))
    levels = 1 << (bits - 1)
    for start in range(0, n, 256):
        xs, ys, ks = x[start : start + 256], y[start : start + 256], kept[start : start + 256]
        step = float(xs.abs().max()) / levels * (1 + 2**-7)  # the scale is the absmax rounded up to bfloat16
        # a kept value is at least the smallest level (one step): below it, it rounds up to that level
        err = (ys[ks] - xs[ks]).abs()
        assert bool((err <= torch.clamp(step - xs[ks].abs(), min=step / 2) + 1e-6).all())


@pytest.mark.parametrize(("block", "density"), [(256, 0.04), (256, 0.25), (64, 0.05), (100, 0.04), (1024, 0.02)])
def test_the_two_stage_selection_keeps_what_a_full_ranking_keeps(block: int, density: float) -> None:
    """The grouped top-k (sparse.GROUP candidates per group) against one plain ranking per block, on rows built to
    trip it: the largest values packed into neighbouring groups, one large value per group, ties, and zeros."""
    codec = sparse(block_size=block, density=density)
    k, rows = codec.k, 40
    x = torch.randn(rows, block, generator=torch.Generator().manual_seed(block))
    x[0, : 2 * k] = 50.0 + torch.arange(2 * k)  # every kept value in the first few groups
    x[1, ::GROUP] = -9.0  # as many group maxima as groups, all equal
    x[2] = 1.0  # all ties
    x[3] = 0.0
    x[3, block - 1] = -2.0
    x[4] = -0.0
    scales, index, values = torch.empty(rows), torch.empty(rows * k, dtype=torch.int64), torch.empty(rows * k)
    SparseCodec._top_k(x, k, scales, index, values)
    idx = index.view(rows, k)
    assert bool((idx[:, 1:] > idx[:, :-1]).all())  # ascending, no position twice
    ranked = x.abs().topk(k, dim=1).values.sort(dim=1).values
    assert torch.equal(x.abs().gather(1, idx).sort(dim=1).values, ranked)  # the same magnitudes (ties: any of them)
    assert torch.equal(values, x.gather(1, idx).reshape(-1))
    assert torch.equal(scales, x.abs().amax(dim=1))


@pytest.mark.parametrize("bits", BITS_CHOICES)
def test_values_on_the_level_grid_round_trip_exactly(bits: int) -> None:
    """A kept value that is a level (j * absmax / 2^(bits-1), j >= 1) decodes bit-exactly; the rest decodes to 0."""
    levels = 1 << (bits - 1)
    codec = sparse(bits=bits, density=8 / 256)  # k = 8
    gen = torch.Generator().manual_seed(bits)
    x = torch.zeros(3 * 256 + 40)
    for start, length in ((0, 256), (256, 256), (512, 256), (768, 40)):
        scale = 2.0 ** int(torch.randint(-20, 20, (1,), generator=gen))
        pos = start + torch.randperm(length, generator=gen)[:8]
        lv = torch.randint(1, levels + 1, (8,), generator=gen).float()
        lv[0] = levels  # the block absmax is the top level
        sign = torch.where(torch.rand(8, generator=gen) < 0.5, -1.0, 1.0)
        x[pos] = sign * lv * (scale / levels)
    y = codec.decode(codec.encode(x), x.numel())
    assert torch.equal(y, x)


def test_all_zero_and_tiny_inputs() -> None:
    codec = sparse()
    for x in (torch.zeros(700), torch.full((300,), 1e-42), torch.tensor([-3.0])):
        y = codec.decode(codec.encode(x), x.numel())
        assert bool(torch.isfinite(y).all()) and (y != 0).sum() <= 3 * codec.k
    assert torch.equal(codec.decode(codec.encode(torch.zeros(700)), 700), torch.zeros(700))
    assert codec.decode(codec.encode(torch.tensor([-3.0])), 1).tolist() == [-3.0]
    assert codec.decode(codec.encode(torch.empty(0)), 0).numel() == 0


@pytest.mark.parametrize("bits", BITS_CHOICES)
@pytest.mark.parametrize(("block", "density"), [(256, 0.04), (4, 0.25), (300, 0.02), (7, 1.0)])
def test_encode_frame_into_writes_exactly_what_its_frame_decodes_to(bits: int, block: int, density: float) -> None:
    """An owner keeps its own average from the encoder instead of decoding its frame again: every member decodes
    that frame, so the two must agree to the bit (one model, max param diff 0)."""
    codec = sparse(bits=bits, block_size=block, density=density)
    for n, seed in [(1, 0), (block - 1, 1), (block, 2), (10 * block + 3, 3), (100_003, 4)]:
        x = sample(n, seed) * torch.linspace(1e-3, 30.0, n)
        x[:: max(1, n // 7)] = 0.0  # zeros, ties among the dropped
        out = torch.full((n,), float("nan"))
        frame = codec.encode_frame_into(x, out)
        assert bytes(frame) == codec.encode(x)  # the same bytes as without the copy
        assert torch.equal(out, codec.decode(bytes(frame), n))
    zeros = torch.full((0,), 1.0)
    assert bytes(codec.encode_frame_into(torch.empty(0), zeros)) == codec.encode(torch.empty(0))
    with pytest.raises(ValueError, match="contiguous float32 tensor of 5 values"):
        codec.encode_frame_into(sample(5), torch.empty(4))
    with pytest.raises(CodecError):
        codec.encode_frame_into(torch.tensor([1.0, float("nan")]), torch.empty(2))


def test_same_bytes_every_time_and_for_every_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    x = sample(300_000) * torch.linspace(0.01, 10, 300_000)
    frame = sparse().encode(x)
    assert sparse().encode(x) == frame
    monkeypatch.setattr("peerd.codecs.sparse.CHUNK_ELEMS", 1000)
    assert sparse().encode(x) == frame


def test_encode_refuses_nan_inf_and_bad_tensors() -> None:
    codec = sparse()
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = sample()
        x[517] = bad  # not among the kept values' block absmax if it were finite: still refused
        with pytest.raises(CodecError, match="NaN or Inf"):
            codec.encode(x)
    for x in (torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2)):
        with pytest.raises(CodecError):
            codec.encode(x)


# -- error feedback -----------------------------------------------------------------------------------------------
def test_dropped_mass_goes_to_error_feedback_and_comes_back() -> None:
    codec, fb = sparse(), ErrorFeedback()
    x = sample(2560, seed=1)
    y = codec.decode(fb.encode(codec, "w", x), x.numel())
    residual = fb.state_dict()["w"]
    kept = y != 0
    assert torch.equal(residual[~kept], x[~kept])  # every dropped value is carried whole
    assert torch.equal(residual + y, x)  # nothing is lost: sent + carried = input (exact: kept values lose no bits)
    assert kept.sum() == 10 * codec.k
    # Over rounds, what was sent tracks the running sum of the inputs within one round's residual.
    sent, total = y.clone(), x.clone()
    for t in range(60):
        g = sample(2560, seed=100 + t)
        total += g
        sent += codec.decode(fb.encode(codec, "w", g), 2560)
    assert torch.allclose(sent + fb.state_dict()["w"], total, atol=1e-4)
    assert float((sent - total).norm()) < 0.5 * float(total.norm())


def test_a_decaying_residual_fades_instead_of_coming_back_whole() -> None:
    """decay < 1 (SparseLoCo's accumulator): the next round adds back decay * residual, and what is kept is still
    everything that round's compensated input did not deliver."""
    codec, fb = sparse(), ErrorFeedback(decay=0.5)
    x = sample(2560, seed=2)
    fb.encode(codec, "w", x)
    residual = fb.state_dict()["w"]
    g = sample(2560, seed=3)
    compensated = fb.compensate("w", g)
    assert torch.equal(compensated, g + 0.5 * residual)
    y = codec.decode(fb.encode(codec, "w", g), 2560)
    assert torch.allclose(fb.state_dict()["w"] + y, compensated, atol=1e-6)
    # With no new input the carried mass shrinks geometrically rather than waiting, whole, for its turn.
    for _ in range(40):
        fb.encode(codec, "w", torch.zeros(2560))
    assert float(fb.state_dict()["w"].abs().max()) < 1e-6 * float(residual.abs().max())


def test_feedback_against_the_average_keeps_what_the_owner_dropped() -> None:
    """Three members' contributions, averaged and re-sparsified by the shard owner on the way back (as a round does).
    Kept against the applied average, the members' residuals add up to all that the round dropped; kept against
    each member's own decoded contribution, what the owner's re-encoding dropped is lost."""
    codec = sparse()
    inputs = [sample(2560, seed=10 + i) for i in range(3)]
    decoded = [codec.decode(codec.encode(x), 2560) for x in inputs]
    applied = codec.decode(codec.encode(torch.stack(decoded).mean(0)), 2560)  # the owner re-sparsifies the average
    mean_in = torch.stack(inputs).mean(0)
    against_avg, against_own = [ErrorFeedback(against="average") for _ in inputs], [ErrorFeedback() for _ in inputs]
    for x, d, fa, fo in zip(inputs, decoded, against_avg, against_own, strict=True):
        fa.settle("w", x, d, applied)
        fo.settle("w", x, d, applied)
    carried_avg = torch.stack([f.state_dict()["w"] for f in against_avg]).mean(0)
    carried_own = torch.stack([f.state_dict()["w"] for f in against_own]).mean(0)
    assert torch.allclose(carried_avg + applied, mean_in, atol=1e-6)  # nothing lost
    lost = float((mean_in - applied - carried_own).norm())
    assert lost > 0.1 * float(applied.norm())  # the classic variant loses the owner's cut
    # A lossless round (no decoded contribution): the classic variant carries nothing.
    lossless = ErrorFeedback()
    lossless.settle("w", inputs[0], None, applied)
    assert "w" not in lossless


def test_error_feedback_parameters_are_checked() -> None:
    for bad in ({"decay": 0.0}, {"decay": 1.5}, {"decay": True}, {"against": "owner"}):
        with pytest.raises(ValueError):
            ErrorFeedback(**bad)  # type: ignore[arg-type]
    ok = {"name": "sparse", "error_feedback": True}
    for raw, match in (
        ({"codec": {"name": "int4", "feedback_decay": 0.8}}, "need codec.error_feedback = true"),
        ({"codec": {**ok, "feedback_decay": 0.0}}, "codec.feedback_decay must be in"),
        ({"codec": {**ok, "feedback_against": "owner"}}, "codec.feedback_against must be one of"),
    ):
        with pytest.raises(ConfigError, match=match):
            RunConfig.from_dict(raw)
    # Default keys stay out of the run spec (existing runs keep their ids); set ones are part of it.
    assert "feedback_decay" not in RunConfig.from_dict({"codec": ok}).spec()["codec"]
    tuned = RunConfig.from_dict({"codec": {**ok, "feedback_decay": 0.8, "feedback_against": "average"}}).spec()
    assert tuned["codec"]["feedback_decay"] == 0.8 and tuned["codec"]["feedback_against"] == "average"
    # `--codec sparse` adds the SparseLoCo recipe; Streaming's merges fully (it diverged with alpha 0.5 at lr 3).
    diloco = sparse_recipe("diloco")
    assert diloco["outer"] == {"momentum": 0.0, "lr": 5.0} and "streaming" not in diloco
    assert sparse_recipe("streaming")["streaming"] == {"alpha": 0.0}
    assert sparse_recipe("streaming")["codec"] == sparse_recipe("diloco")["codec"]
    for algorithm in ("diloco", "streaming"):
        RunConfig.from_dict({"run": {"algorithm": algorithm}, "codec": {"name": "sparse"}, **sparse_recipe(algorithm)})


# -- wire size ----------------------------------------------------------------------------------------------------
def test_wire_bytes_at_least_50x_fewer_than_fp32() -> None:
    codec = sparse(zstd=False)
    n = 10_000_000
    assert codec.k == 11 and codec.max_encoded_size(n) * 50 <= 4 * n  # bound, header, scales, indices included
    blocks = -(-n // 256)
    body = 2 * blocks + blocks * 11 + -(-blocks * 11 * 2 // 8)  # bf16 scales, 1-byte indices, 2-bit codes
    assert codec.max_encoded_size(n) == HEADER_SIZE + body + TRAILER_SIZE
    frame = sparse().encode(sample(n))  # zstd on: never larger than the bound
    assert len(frame) * 50 <= 4 * n, len(frame)
    assert 4 * n / codec.max_encoded_size(n) > 64


# -- hostile frames -----------------------------------------------------------------------------------------------
def test_hostile_frames_are_refused() -> None:
    codec = sparse(zstd=False)
    x = sample(N)
    frame = codec.encode(x)
    full, tail = divmod(N, 256)
    n = full * codec.k + min(codec.k, tail)
    idx0 = 2 * (full + 1)  # first index byte, after one bfloat16 scale per block
    code0 = idx0 + n

    def refused(new_body: bytearray, match: str) -> None:
        with pytest.raises(CodecError, match=match):
            codec.decode(with_body(frame, new_body), N)

    for scale in (float("nan"), float("inf"), -1.0):
        b = body(frame)
        b[2:4] = struct.pack("<f", scale)[2:]  # the bfloat16: a float32's upper half
        refused(b, "scale")
    b = body(frame)
    b[idx0] = 250  # the first block's first position at 250: its next ones run past 255
    refused(b, "past the end")
    b = body(frame)
    b[code0 - 1] = 255  # the tail block holds 1000 - 768 = 232 values: a gap of 255 runs past its end
    refused(b, "past the end")
    odd = codec.encode(sample(258))  # 11 + 2 codes of 2 bits: the last byte's top 6 bits are padding
    b = body(odd)
    b[-1] |= 0x80
    with pytest.raises(CodecError, match="padding"):
        codec.decode(with_body(odd, b), 258)
    # a smaller block makes every index above it out of range
    small = sparse(block_size=100, zstd=False)
    f = bytearray(small.encode(sample(N)))
    f[HEADER_SIZE + 2 * 10 + small.k - 1] = 100  # the first block's last gap: past position 99
    with pytest.raises(CodecError, match="past the end"):
        small.decode(reseal(f), N)
    # the frame machinery: truncated, oversized, lying numel, another codec's frame or parameters
    for cut in (0, 10, HEADER_SIZE, len(frame) - 1):
        with pytest.raises(CodecError, match=r"empty|truncated"):
            codec.decode(frame[:cut], N)
    with pytest.raises(CodecError, match="oversized"):
        codec.decode(frame + b"\0", N)
    for numel in (N + 1, MAX_NUMEL, 2**40):
        with pytest.raises(CodecError, match="elements"):
            codec.decode(frame, numel)
        with pytest.raises(CodecError):
            codec.decode(with_fields(frame, numel=numel), N)
    with pytest.raises(CodecError, match="codec id"):
        codec.decode(make_codec("int4").encode(x), N)
    with pytest.raises(CodecError, match="codec id"):
        make_codec("int4").decode(frame, N)
    with pytest.raises(CodecError, match="scales/payload"):
        sparse(density=0.05).decode(frame, N)
    with pytest.raises(CodecError, match="scales/payload"):
        sparse(bits=4).decode(frame, N)


def test_every_single_byte_flip_is_caught() -> None:
    frame = sparse(zstd=False).encode(sample(300))
    for i in range(len(frame)):
        bad = bytearray(frame)
        bad[i] ^= 0x01
        with pytest.raises(CodecError):
            sparse().decode(bytes(bad), 300)


def test_resealed_random_bodies_decode_finite_or_raise() -> None:
    codec = sparse(zstd=False)
    frame = codec.encode(sample(N))
    gen = torch.Generator().manual_seed(7)
    outcomes = set()
    for _ in range(300):
        b = body(frame)
        for pos in torch.randint(0, len(b), (3,), generator=gen).tolist():
            b[pos] = int(torch.randint(0, 256, (1,), generator=gen))
        try:
            y = codec.decode(with_body(frame, b), N)
        except CodecError:
            outcomes.add("refused")
        else:
            assert y.shape == (N,) and bool(torch.isfinite(y).all()) and (y != 0).sum() <= 4 * codec.k
            outcomes.add("decoded")
    assert outcomes == {"refused", "decoded"}


def test_parameters_are_validated() -> None:
    for bad in (dict(density=0.0), dict(density=1.5), dict(density=float("nan")), dict(bits=3), dict(bits=True)):
        with pytest.raises(ValueError, match=r"density|bits"):
            make_codec("sparse", **bad)  # type: ignore[arg-type]
    for block in (1, MAX_SPARSE_BLOCK + 1, 2.0):
        with pytest.raises(ValueError, match="block_size"):
            make_codec("sparse", block_size=block)  # type: ignore[arg-type]
    assert sparse(block_size=MAX_SPARSE_BLOCK).index_bytes == 2 and sparse(block_size=256).index_bytes == 1
    assert sparse(density=0.03, block_size=100).k == 3 and sparse(density=1.0).k == 256
    big = sparse(block_size=4096, density=0.01)
    x = sample(10_000)
    assert torch.equal(big.decode(big.encode(x), x.numel()) != 0, top_k_mask(x, 4096, big.k))
    assert "sparse" in ALL_CODEC_NAMES and CODEC_IDS["sparse"] == 7
    assert parse_header(sparse().encode(x)).codec_id == 7


# -- config -------------------------------------------------------------------------------------------------------
def test_config_keys_and_their_refusals() -> None:
    assert (CodecSection().density, CodecSection().bits) == (DEFAULT_DENSITY, DEFAULT_BITS)
    assert SPARSE_BITS == BITS_CHOICES and SPARSE_MAX_BLOCK == MAX_SPARSE_BLOCK
    assert CONFIG_FEEDBACK_AGAINST == FEEDBACK_AGAINST  # config.py stays free of torch, so it keeps its own copy
    ok = {"name": "sparse", "error_feedback": True}
    cfg = RunConfig.from_dict({"codec": {**ok, "density": 0.01, "bits": 4}})
    assert cfg.spec()["codec"]["density"] == 0.01 and cfg.spec()["codec"]["bits"] == 4
    assert cfg.run_id() != RunConfig.from_dict({"codec": ok}).run_id()
    # other codecs leave the keys out of the spec: their run ids are what they were before the keys existed
    assert "density" not in RunConfig().spec()["codec"] and "bits" not in RunConfig().spec()["codec"]
    refusals = [
        ({"codec": {**ok, "density": 0.0}}, "codec.density must be in"),
        ({"codec": {**ok, "density": 1.01}}, "codec.density must be in"),
        ({"codec": {**ok, "bits": 3}}, "codec.bits must be one of"),
        ({"codec": {"name": "int4", "density": 0.05}}, "codec.density only applies"),
        ({"codec": {"name": "fp32", "bits": 4}}, "codec.bits only applies"),
        ({"codec": {"name": "sparse"}}, "needs codec.error_feedback = true"),
        ({"codec": ok, "run": {"algorithm": "noloco"}}, "needs run.algorithm = 'diloco' or 'streaming'"),
        ({"codec": {**ok, "block_size": 1 << 17}}, "codec.block_size"),
    ]
    for raw, match in refusals:
        with pytest.raises(ConfigError, match=match) as exc:
            RunConfig.from_dict(raw)
        assert "\n" not in str(exc.value)


def test_wire_ratio_is_what_the_docs_say() -> None:
    codec = sparse(zstd=False)
    per_block = (codec.max_encoded_size(256 * 4096) - HEADER_SIZE - TRAILER_SIZE) / 4096
    assert per_block == 15.75 and math.isclose(1024 / per_block, 65.02, rel_tol=1e-3)
    light = sparse(zstd=False, density=0.02)
    per_block = (light.max_encoded_size(256 * 4096) - HEADER_SIZE - TRAILER_SIZE) / 4096
    assert per_block == 9.5 and math.isclose(1024 / per_block, 107.8, rel_tol=1e-3)


# -- in a swarm: tests/test_codec_swarm.py (3 peers, DiLoCo and Streaming, identical globals) -----------------------
def test_the_daemon_builds_the_sparse_codec_the_config_asks_for(tmp_path: Path) -> None:
    from peerd.daemon import Daemon
    from peerd.identity import Identity

    cfg = RunConfig.from_dict({"codec": {"name": "sparse", "density": 0.05, "bits": 4, "error_feedback": True}})
    daemon = Daemon(cfg, Identity.generate(), listen="127.0.0.1:0", data_dir=tmp_path, insecure=True)
    assert isinstance(daemon.codec, SparseCodec)
    assert (daemon.codec.density, daemon.codec.bits) == (0.05, 4)
