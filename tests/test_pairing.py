"""NoLoCo matchmaking and exchange (peerd/pairing.py) on one event loop: several real Pairing endpoints talk through
an in-memory transport with random latencies, so proposals really race. Only the wire is replaced: requests are
signed and verified, and tensors are framed, encoded and decoded exactly as over gRPC."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch

from peerd.codecs import make_codec
from peerd.envelope import Verifier, sign
from peerd.identity import Identity
from peerd.pair_exchange import PairingError, PairSettings
from peerd.pairing import Pairing, PairOutcome
from peerd.v1 import peerd_pb2 as pb

RUN_ID = b"r" * 32
END = object()


class MemCall:
    """A stream call in memory: the server generator runs in its own task (as under gRPC) and cancel() stops it."""

    def __init__(self, gen: AsyncIterator[pb.TensorMessage], cut_after: int | None = None) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cut_after = cut_after
        self.task = asyncio.ensure_future(self._pump(gen))

    async def _pump(self, gen: AsyncIterator[pb.TensorMessage]) -> None:
        try:
            async for msg in gen:
                await self.queue.put(msg)
            await self.queue.put(END)
        except Exception as exc:
            await self.queue.put(exc)

    def __aiter__(self) -> MemCall:
        return self

    async def __anext__(self) -> pb.TensorMessage:
        item = await self.queue.get()
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> bool:
        self.task.cancel()
        return True


class Net:
    """Pairing endpoints wired to each other; `dead` peers refuse connections and drop their streams."""

    def __init__(self, latency: tuple[float, float] = (0.001, 0.01), seed: int = 0) -> None:
        self.nodes: dict[str, Pairing] = {}
        self.infos: dict[str, pb.PeerInfo] = {}
        self.rng = random.Random(seed)
        self.latency = latency
        self.dead: set[str] = set()
        self.requests_cut_after: dict[str, int] = {}  # peer id -> messages it sends before its link breaks

    def delay(self) -> float:
        return self.rng.uniform(*self.latency)

    def add(
        self,
        settings: PairSettings,
        numel: int,
        *,
        step: int = 0,
        codec: str = "fp32",
        seed: int = 0,
        ident: Identity | None = None,
    ) -> Pairing:
        ident = ident or Identity.generate()
        info = pb.PeerInfo(
            peer_id=ident.peer_id, public_key=ident.public_key, address=ident.peer_id[:8], outer_step=step
        )
        self.infos[ident.peer_id] = info
        pairing = Pairing(
            identity=ident,
            run_id=RUN_ID,
            verifier=Verifier(RUN_ID),
            codec=make_codec(codec),
            executor=None,
            numel=numel,
            settings=settings,
            transport=MemTransport(self, ident.peer_id),
            candidates=lambda me=ident.peer_id: [i for pid, i in self.infos.items() if pid != me],
            lookup=self.infos.get,
            me=lambda me=ident.peer_id: self.infos[me],
            rng=random.Random(seed),
        )
        self.nodes[ident.peer_id] = pairing
        return pairing


class MemTransport:
    def __init__(self, net: Net, owner: str) -> None:
        self.net = net
        self.owner = owner

    async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse:
        if peer.peer_id in self.net.dead or self.owner in self.net.dead:
            raise ConnectionRefusedError(f"{peer.peer_id[:8]} is down")
        await asyncio.sleep(self.net.delay())
        target = self.net.nodes[peer.peer_id]
        sender = target.verifier.verify("Match", request)
        resp = await asyncio.wait_for(target.answer(request, sender), timeout)
        await asyncio.sleep(self.net.delay())
        return resp

    def exchange(self, peer: pb.PeerInfo, requests: AsyncIterator[pb.TensorMessage], timeout: float) -> MemCall:
        if peer.peer_id in self.net.dead:
            raise ConnectionRefusedError(f"{peer.peer_id[:8]} is down")
        cut = self.net.requests_cut_after.get(self.owner)
        return MemCall(self.net.nodes[peer.peer_id].serve(_cut(requests, cut)))


async def _cut(messages: AsyncIterator[pb.TensorMessage], after: int | None) -> AsyncIterator[pb.TensorMessage]:
    """Forward messages; after `after` of them the sender's link breaks (the server sees a dead client)."""
    n = 0
    async for msg in messages:
        if after is not None and n >= after:
            raise ConnectionResetError("link broke mid-stream")
        n += 1
        yield msg


def tensors_for(i: int, numel: int, kinds: Sequence[str] = ("phi", "pair")) -> dict[str, torch.Tensor]:
    """Member i's tensors of `kinds` (a Pairing's `kinds`: without send-ahead the one combined "mix")."""
    g = torch.Generator().manual_seed(i)
    both = {"phi": torch.randn(numel, generator=g), "pair": torch.randn(numel, generator=g) * 0.01}
    both["mix"] = both["pair"] * 0.7 + both["phi"] * 0.7
    return {k: both[k] for k in kinds}


async def run_all(pairings: Sequence[Pairing], step: int | Sequence[int] = 0, numel: int = 8) -> list[PairOutcome]:
    steps = [step] * len(pairings) if isinstance(step, int) else list(step)
    return await asyncio.gather(
        *(p.run_round(s, tensors_for(i, numel, p.kinds)) for i, (p, s) in enumerate(zip(pairings, steps, strict=True)))
    )


def partners(outcomes: Sequence[PairOutcome], pairings: Sequence[Pairing]) -> dict[str, set[str]]:
    """Each peer's group as it sees it, checked for consistency: groups are disjoint and agreed on by all members."""
    groups: dict[str, set[str]] = {}
    for p, out in zip(pairings, outcomes, strict=True):
        members = set(out.expected)
        assert p.my_id in members
        assert len(members) == len(out.expected), "a peer appears twice in a group"
        groups[p.my_id] = members
    for pid, members in groups.items():
        for other in members:
            assert groups[other] == members, f"{pid[:8]} thinks it is with {other[:8]}, who disagrees"
    return groups


def settings(**kw: Any) -> PairSettings:
    base = {"match_timeout": 3.0, "exchange_timeout": 10.0}
    base.update(kw)
    return PairSettings(**base)


# -- matchmaking --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_many_concurrent_proposers_form_disjoint_pairs(seed: int) -> None:
    async def main() -> None:
        net = Net(seed=seed)
        peers = [net.add(settings(), 8, seed=seed * 100 + i) for i in range(6)]
        outcomes = await run_all(peers)
        groups = partners(outcomes, peers)
        for pid, members in groups.items():
            assert len(members) == 2, f"{pid[:8]} ended in group of {len(members)}"  # six peers: three pairs
        for out in outcomes:
            assert not out.lost and len(out.contributions) == 2
            assert out.note.startswith("partner ")

    asyncio.run(main())


def test_odd_peer_steps_alone_by_the_deadline() -> None:
    async def main() -> None:
        net = Net(seed=3)
        peers = [net.add(settings(match_timeout=0.8), 8, seed=i) for i in range(3)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outcomes = await run_all(peers)
        assert loop.time() - t0 < 0.8 + 3 + 1  # the deadline, plus at most one Match call in flight
        groups = partners(outcomes, peers)
        sizes = sorted(len(g) for g in groups.values())
        assert sizes == [1, 2, 2]
        solo = next(o for o in outcomes if o.solo)
        assert solo.note == "no partner" and solo.included == solo.expected and not solo.lost

    asyncio.run(main())


def test_crossed_proposals_are_broken_by_peer_id() -> None:
    """Two peers propose to each other at once: the lower id refuses, then accepts the higher id's proposal."""

    async def main() -> None:
        net = Net(latency=(0.02, 0.02))
        peers = [net.add(settings(), 8, seed=i) for i in range(2)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outcomes = await run_all(peers)
        assert loop.time() - t0 < 1.0  # no retries with backoff, no hold timeouts: one extra round trip
        high = max(p.my_id for p in peers)
        for out in outcomes:
            assert out.expected[0] == high, "the higher id's proposal should win"
            assert len(out.contributions) == 2

    asyncio.run(main())


def test_nobody_pairs_with_itself() -> None:
    async def main() -> None:
        net = Net()
        p = net.add(settings(), 8)
        p.progress(0, 0.0, 1.0)
        req = sign(pb.MatchRequest(step=0, group_size=2), "Match", p.identity, RUN_ID)
        resp = await p.answer(req, p.my_id)
        assert not resp.accepted and "itself" in resp.reason
        # and alone in the swarm, a round ends solo rather than pairing with itself
        out = await p.run_round(0, tensors_for(0, 8, p.kinds))
        assert out.solo and out.expected == [p.my_id]

    asyncio.run(main())


def test_a_peer_in_a_group_refuses_further_proposals() -> None:
    async def main() -> None:
        net = Net()
        a, b, c = (net.add(settings(), 8, seed=i) for i in range(3))
        a.progress(0, 0.0, 1.0)  # ready now
        req_b = sign(pb.MatchRequest(step=0, group_size=2), "Match", b.identity, RUN_ID)
        assert (await a.answer(req_b, b.my_id)).accepted
        req_c = sign(pb.MatchRequest(step=0, group_size=2), "Match", c.identity, RUN_ID)
        resp = await a.answer(req_c, c.my_id)
        assert not resp.accepted and resp.reason.startswith("busy")

    asyncio.run(main())


def test_staleness_is_respected() -> None:
    async def main() -> None:
        net = Net()
        s = settings(match_timeout=0.6, max_staleness=1)
        near = [net.add(s, 8, step=5, seed=0), net.add(s, 8, step=6, seed=1)]
        far = net.add(s, 8, step=8, seed=2)
        outcomes = await run_all([*near, far], step=[5, 6, 8])
        groups = partners(outcomes, [*near, far])
        assert groups[near[0].my_id] == {near[0].my_id, near[1].my_id}  # one step apart: allowed
        assert outcomes[2].solo  # two steps from everyone: nobody may pair with it
        # and a peer refuses a proposal for a step too far from its own, whatever the proposer claims
        lone = net.add(s, 8, step=0, seed=3)
        lone.progress(0, 0.0, 1.0)
        req = sign(pb.MatchRequest(step=2, group_size=2), "Match", far.identity, RUN_ID)
        resp = await lone.answer(req, far.my_id)
        assert not resp.accepted and resp.reason.startswith("stale")

    asyncio.run(main())


def test_a_peer_ahead_waits_for_a_lagging_peer_but_not_forever() -> None:
    """Bounded staleness: peers at step 5 do not start matching while a live peer is still at step 3."""

    async def main() -> None:
        net = Net()
        s = settings(match_timeout=1.0)
        a, c = net.add(s, 8, step=5, seed=0), net.add(s, 8, step=5, seed=1)
        lagging = net.add(s, 8, step=3, seed=2)
        loop = asyncio.get_running_loop()

        async def catch_up() -> float:
            await asyncio.sleep(0.5)
            net.infos[lagging.my_id].outer_step = 4  # one step behind is within max_staleness
            return loop.time()

        caught_up, oa, _ = await asyncio.gather(
            catch_up(), a.run_round(5, tensors_for(0, 8, a.kinds)), c.run_round(5, tensors_for(1, 8, c.kinds))
        )
        assert oa.match_seconds < 0.5  # matching began only once the lagging peer caught up...
        assert oa.stats.seconds >= 0.5 and set(oa.expected) == {a.my_id, c.my_id}
        net.infos[lagging.my_id].outer_step = 3  # ...and a peer that never catches up delays us only match_timeout
        t0 = loop.time()
        oa, _ = await asyncio.gather(
            a.run_round(5, tensors_for(0, 8, a.kinds)), c.run_round(5, tensors_for(1, 8, c.kinds))
        )
        assert 1.0 <= loop.time() - t0 < 1.0 + 1.0
        assert set(oa.expected) == {a.my_id, c.my_id}
        assert caught_up > 0

    asyncio.run(main())


def test_a_peer_far_from_its_boundary_does_not_accept() -> None:
    async def main() -> None:
        net = Net()
        a, b = net.add(settings(match_timeout=2.0), 8), net.add(settings(match_timeout=2.0), 8)
        req = sign(pb.MatchRequest(step=0, group_size=2), "Match", b.identity, RUN_ID)
        a.progress(0, 30.0, 40.0)  # 30 s of inner steps left: a proposer would idle that long
        resp = await a.answer(req, b.my_id)
        assert not resp.accepted and resp.reason.startswith("not ready")
        a.progress(0, 0.5, 40.0)  # due within match_timeout / 2
        req = sign(pb.MatchRequest(step=0, group_size=2), "Match", b.identity, RUN_ID)
        assert (await a.answer(req, b.my_id)).accepted

    asyncio.run(main())


def test_pairings_are_unbiased() -> None:
    """Over many outer steps each peer meets every other peer about equally often. The pairings race (random
    latencies, real scheduling), so a partner's count is about Binomial(60, 1/3): mean 20, sd 3.7. At most 6 happens
    by chance once in about 12,000 runs (45 steps and at most 6 failed one CI run in about 160); a real bias (a
    partner seldom or never drawn) still fails it."""

    async def main() -> Counter[tuple[str, str]]:
        net = Net(seed=11)
        peers = [net.add(settings(), 4, seed=1000 + i) for i in range(4)]
        met: Counter[tuple[str, str]] = Counter()
        for step in range(60):
            for p in peers:
                net.infos[p.my_id].outer_step = step
            outcomes = await run_all(peers, step=step, numel=4)
            for pid, members in partners(outcomes, peers).items():
                for other in members - {pid}:
                    met[(pid, other)] += 1
        return met

    met = asyncio.run(main())
    ids = sorted({a for a, _ in met})
    for a in ids:
        counts = [met[(a, b)] for b in ids if b != a]
        assert sum(counts) >= 54, counts  # nearly every step paired
        assert min(counts) >= 7, f"{a[:8]} met its partners {counts} times (expected about 20 each)"


def test_proposer_that_never_opens_the_stream_frees_the_accepter() -> None:
    async def main() -> None:
        net = Net()
        s = settings(match_timeout=0.5)
        a, b, c = (net.add(s, 8, seed=i) for i in range(3))
        a.progress(0, 0.0, 1.0)
        req = sign(pb.MatchRequest(step=0, group_size=2), "Match", b.identity, RUN_ID)
        assert (await a.answer(req, b.my_id)).accepted  # b never follows up
        await asyncio.sleep(0.5 + 5.0 + 0.2)  # match_timeout + the confirmation grace
        req = sign(pb.MatchRequest(step=0, group_size=2), "Match", c.identity, RUN_ID)
        assert (await a.answer(req, c.my_id)).accepted

    asyncio.run(main())


# -- exchange -----------------------------------------------------------------------------------------------------
def test_exchange_delivers_each_partners_tensors() -> None:
    async def main() -> None:
        net = Net()
        a, b = net.add(settings(), 300, codec="int8"), net.add(settings(), 300, codec="int8")
        ta, tb = tensors_for(0, 300, a.kinds), tensors_for(1, 300, b.kinds)
        oa, ob = await asyncio.gather(a.run_round(0, ta), b.run_round(0, tb))
        for kind in a.kinds:
            assert oa.contributions[a.my_id][kind] is ta[kind]  # our own terms never go through the codec
            got = oa.contributions[b.my_id][kind]
            bound = tb[kind].abs().max() / 127  # int8 absmax: at most one quantization step off
            assert (got - tb[kind]).abs().max() <= bound
            assert not torch.equal(got, tb[kind])  # it really was quantized
            assert torch.allclose(ob.contributions[a.my_id][kind], ta[kind], atol=float(ta[kind].abs().max() / 127))
        assert oa.stats.wire_bytes > 0 and oa.stats.received_wire_bytes > 0
        assert oa.stats.wire_bytes == ob.stats.received_wire_bytes  # counted in full, even if still uploading
        assert ob.stats.wire_bytes == oa.stats.received_wire_bytes
        assert oa.stats.wire_bytes < oa.stats.raw_bytes  # 8 bits instead of 32

    asyncio.run(main())


def test_send_ahead_streams_phi_before_the_boundary() -> None:
    async def main() -> None:
        net = Net()
        s = settings(send_ahead=True)
        a, b = net.add(s, 64, seed=0), net.add(s, 64, seed=1)
        ta, tb = tensors_for(0, 64), tensors_for(1, 64)
        for p, t in ((a, ta), (b, tb)):
            p.progress(0, 1.0, 1.0)
            await p.start_ahead(0, t["phi"])
        for _ in range(100):  # "training": wait until each has the other's phi
            sessions = [p._session for p in (a, b)]
            if all(x is not None and any("phi" in r for r in x.received.values()) for x in sessions):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("phi did not arrive ahead of the boundary")
        for x in sessions:
            assert x is not None and all("pair" not in r for r in x.received.values())
        oa, ob = await asyncio.gather(a.run_round(0, ta), b.run_round(0, tb))
        assert torch.equal(oa.contributions[b.my_id]["phi"], tb["phi"])
        assert torch.equal(ob.contributions[a.my_id]["pair"], ta["pair"])

    asyncio.run(main())


def test_send_ahead_without_partner_steps_alone() -> None:
    async def main() -> None:
        net = Net()
        a = net.add(settings(send_ahead=True, match_timeout=0.3), 8)
        await a.start_ahead(0, tensors_for(0, 8)["phi"])
        await asyncio.sleep(0.4)
        out = await a.run_round(0, tensors_for(0, 8))
        assert out.solo

    asyncio.run(main())


def test_groups_of_three_share_every_contribution() -> None:
    async def main() -> None:
        net = Net(seed=5)
        s = settings(group_size=3)
        peers = [net.add(s, 16, seed=i) for i in range(3)]
        outcomes = await run_all(peers, numel=16)
        partners(outcomes, peers)
        truth = {p.my_id: tensors_for(i, 16, p.kinds) for i, p in enumerate(peers)}
        for out in outcomes:
            assert sorted(out.included) == sorted(truth) and not out.lost
            assert out.note.startswith("group ")
            for pid, got in out.contributions.items():
                for kind in peers[0].kinds:
                    assert torch.equal(got[kind], truth[pid][kind])  # fp32: relayed bytes decode exactly

    asyncio.run(main())


def test_partner_lost_mid_stream_leaves_a_partial_outcome() -> None:
    async def main() -> None:
        net = Net()
        s = settings(exchange_timeout=3.0, chunk_bytes=1024)  # many chunks per tensor
        a, b = net.add(s, 4096, seed=0), net.add(s, 4096, seed=1)
        for p in (a, b):
            net.requests_cut_after[p.my_id] = 8  # whoever proposes loses its link inside its first tensor
        outs = await run_all([a, b], numel=4096)
        proposer = outs[0].expected[0]
        survivor, out = next((p, o) for p, o in zip((a, b), outs, strict=True) if p.my_id != proposer)
        assert out.lost == [proposer] and out.included == [survivor.my_id]
        assert out.note.startswith(f"partner {proposer[:8]}; lost {proposer[:8]}")

    asyncio.run(main())


def test_bad_tensors_are_refused_before_any_exchange() -> None:
    async def main() -> None:
        p = Net().add(settings(), 8)
        with pytest.raises(PairingError):
            await p.run_round(0, {"phi": torch.zeros(8), "pair": torch.zeros(8)})  # without send-ahead: "mix" only
        with pytest.raises(PairingError):
            await p.run_round(0, {"mix": torch.zeros(9)})
        p = Net().add(settings(send_ahead=True), 8)
        with pytest.raises(PairingError):
            await p.run_round(0, {"phi": torch.zeros(8)})
        with pytest.raises(PairingError):
            await p.run_round(0, {"phi": torch.zeros(9), "pair": torch.zeros(9)})
        with pytest.raises(PairingError):
            await p.run_round(0, {"phi": torch.zeros(8, dtype=torch.float64), "pair": torch.zeros(8)})

    asyncio.run(main())
    with pytest.raises(PairingError):
        PairSettings(group_size=1)
