"""The swarm as an outer algorithm sees it: the one port through which DiLoCo, Streaming DiLoCo, NoLoCo and the DDP
baseline reach the network (torchft's Manager seam, narrowed to what these algorithms need).

An algorithm asks the swarm to average a vector (`allreduce`, or `allreduce_async` to overlap it with compute), for
the canonical state and a download of it, for its random NoLoCo partners (`open_pairing`), and it reports what it
did with a round (`record_round`, `count_solo_step`). It never sees the membership table, the event loop, channels,
bans or metrics. `DaemonSwarm` implements the port on a running daemon; tests implement it in memory
(tests/fakeswarm.py) to drive an algorithm step by step without processes.

Every method is blocking (or returns a concurrent future) and is called from the training thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc
import torch

from peerd import statefetch
from peerd.allreduce import RoundFailed, RoundResult
from peerd.consistency import Claim
from peerd.matchmaking import GrpcTransport
from peerd.membership import copy_peer
from peerd.pair_exchange import PairSettings
from peerd.pairing import Pairing, PairOutcome
from peerd.relay import RelayTransport, pair_targets
from peerd.sponsor import SponsorDesk, SponsoredWork, SponsorProbe, choose_sponsor
from peerd.sponsor import fetch_average as sponsor_average
from peerd.sponsor import upload as sponsor_upload
from peerd.statesync import StateSnapshot
from peerd.timings import RECOVER
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")


class PairPort(Protocol):
    """NoLoCo's random-partner exchange (peerd/pairing.py), as the algorithm drives it."""

    my_id: str

    def run_round(self, step: int, tensors: Mapping[str, torch.Tensor]) -> PairOutcome:
        """Find a partner for `step` (or give up after the match timeout) and swap tensors; blocking."""

    def start_ahead(self, step: int, phi: torch.Tensor) -> None:
        """Send-ahead: pair now and stream `phi` while we train; returns at once."""

    def progress(self, step: int, eta_s: float, phase_s: float) -> None:
        """Tell matchmaking when we expect to reach the boundary of `step` (it accepts partners due about then)."""

    def close(self) -> None: ...


class SponsorPort(Protocol):
    """DiLoCo's sponsored contributions (peerd/sponsor.py), both roles."""

    def target(self) -> str:
        """The peer to send our work through when the swarm flags our link slow ("" otherwise, or when nobody can
        carry it); gossips our choice, so leaders stop waiting for us (or wait again: "")."""

    def upload(self, sponsor: str, vector: torch.Tensor, base_step: int, tokens: int) -> concurrent.futures.Future:
        """Send our pseudo-gradient to `sponsor`; the future's result is its pb.SponsorResponse."""

    def fetch_average(self, sponsor: str, step: int, numel: int, timeout: float) -> concurrent.futures.Future:
        """Download the average of `sponsor`'s round for `step`, which carried our work; the future's result is
        (its snapshot: "average", work = the peers included; the digest of the state step + 1)."""

    def take(self, step: int, own_norm: float) -> list[SponsoredWork]:
        """Sponsored work our round for `step` carries; `own_norm` is our own pseudo-gradient's (the screen)."""

    def keep_average(self, step: int, average: torch.Tensor, included: int, carried: Sequence[str]) -> None:
        """Our round for `step` carried `carried`'s work: serve its average to them (call before `settle`)."""

    def settle(self, taken: list[SponsoredWork], included_step: int | None) -> None:
        """Our round with `taken` completed at `included_step`, or failed (None: hold them for the next)."""

    def probes(self) -> tuple[int, int]:
        """Probes of the rounds we started while sponsored, and those that found our link recovered."""

    def close(self) -> None: ...


class Swarm(Protocol):
    """What an outer algorithm may ask of the swarm."""

    def allreduce(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> RoundResult:
        """Average `vector` with the peers ready for `step` (and `fragment`), weighted by the `tokens` behind each
        contribution when every member gives some (0: unweighted). `carries`: sponsored peers whose work `vector`
        holds. Raises rendezvous.Behind when the swarm is past `step`, allreduce.RoundFailed when the round could not
        complete."""

    def allreduce_async(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> concurrent.futures.Future:
        """`allreduce` without waiting; `vector` must not change until the future is done."""

    def note_members(self, step: int, peer_ids: Sequence[str]) -> None:
        """These peers finished `step` with us: the next round expects them without waiting for gossip."""

    def skip_rounds(self, step: int, fragments: Sequence[int]) -> None:
        """We will not join these fragment rounds of `step`: as their leader, do not wait for us."""

    def canonical(self, min_step: int = -1) -> Claim | None:
        """The live peers' best state claim when it outranks ours (peerd/consistency.py), else None."""

    def swarm_step(self) -> int:
        """The newest outer step any live peer announced (-1: none)."""

    def finished_step(self) -> int:
        """The newest outer step any peer, live or gone since (its signed leave), announced finishing at (-1: none)."""

    def peer_steps(self) -> list[int]:
        """The outer step every other live peer announced."""

    def fetch_state(
        self,
        min_step: int,
        expected: dict[str, tuple[int, ...]],
        timeout: float = 120.0,
        better: bool = False,
        base: dict[str, torch.Tensor] | None = None,
        parts: list[list[tuple[int, int]]] | None = None,
    ) -> StateSnapshot:
        """Download the canonical state (peerd/statefetch.py); raises RoundFailed when nobody serves it."""

    def open_pairing(self, numel: int) -> PairPort:
        """NoLoCo: this peer's matchmaking and exchange endpoint for flat tensors of `numel` values."""

    def open_sponsoring(self, numel: int) -> SponsorPort:
        """DiLoCo: carry slow-link peers' work in our rounds, and send ours through a sponsor when our link is slow."""

    def record_round(
        self, group: pb.Group, result: RoundResult, fragment: int, note: str = "", rendezvous_s: float = 0.0
    ) -> None:
        """Status, logs and metrics for a round the algorithm ran itself (NoLoCo's pairs)."""

    def count_solo_step(self) -> None: ...

    def count_failure(self, reason: str) -> None: ...

    def screen_partners(
        self, mine: Mapping[str, torch.Tensor], partners: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, str]:
        """Partners whose tensors are out of bounds next to ours, with the reason (peerd/robust.py)."""

    def invalid_contribution(self, peer_id: str, reason: str) -> None:
        """`peer_id` sent data we refused: counted towards its ban."""


class _DaemonPairing:
    """PairPort on the daemon: the Pairing engine runs on the daemon loop; the service routes Match and Exchange
    calls to it."""

    def __init__(self, daemon: Daemon, engine: Pairing) -> None:
        self.daemon = daemon
        self.engine = engine
        self.my_id = engine.my_id

    def run_round(self, step: int, tensors: Mapping[str, torch.Tensor]) -> PairOutcome:
        return self.daemon.call(self.engine.run_round(step, tensors))

    def start_ahead(self, step: int, phi: torch.Tensor) -> None:
        assert self.daemon.loop is not None
        asyncio.run_coroutine_threadsafe(self.engine.start_ahead(step, phi), self.daemon.loop)

    def progress(self, step: int, eta_s: float, phase_s: float) -> None:
        self.engine.progress(step, eta_s, phase_s)

    def close(self) -> None:
        loop = self.daemon.loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self.engine.close(), loop).result(10)


class _DaemonSponsoring:
    """SponsorPort on the daemon: the desk is shared with the Rounds service, which fills it."""

    def __init__(self, daemon: Daemon, desk: SponsorDesk) -> None:
        self.daemon = daemon
        self.desk = desk
        # A verdict lifts after RECOVER normal rounds; two more rounds, and three gossip intervals at least, let the
        # others' lifted verdicts reach us by gossip
        net = daemon.cfg.network
        self.probe = SponsorProbe(daemon.cfg.outer.sponsor_probe, RECOVER + 2, min_s=3 * net.gossip_interval)
        self.probe_step = 0  # our outer step when the probe began: rounds from there on count for it

    def target(self) -> str:
        d = self.daemon

        async def pick() -> str:  # on the loop, which owns the table
            me = d.identity.peer_id
            wanted = (
                d.cfg.outer.slow_link == "sponsor"
                and d.timing.may_be_sponsored(me)
                and not d.round_client.book.self_evidence.startswith("your compute")  # sponsoring fixes links only
            )
            was_probing = self.probe.left > 0
            joined = 0  # rounds we completed as a member since the probe began (counted only while probing)
            if was_probing:
                joined = sum(
                    1 for r in list(d.status.recent_rounds)[-64:] if r.step >= self.probe_step and me in r.included
                )
            plan = self.probe.next(wanted, joined)
            if plan == "probe":
                self.probe_step = d.status.outer_step
                log.warning("trying the swarm's rounds again for %d rounds, to see whether our link keeps up now "
                            "(probe %d)", self.probe.rounds, self.probe.probes)  # fmt: skip
            elif was_probing and not self.probe.left:
                log.warning(
                    "probe over: %s",
                    "the swarm no longer flags our link slow"
                    if plan == "rounds"
                    else f"our link is still slow; next probe after {self.probe.every} sponsored contributions",
                )
            chosen = None
            if plan == "sponsor":
                reach = [p for p in d.membership.alive(include_self=False) if not d.membership.cannot_dial(p.peer_id)]
                chosen = choose_sponsor(me, reach, d.timing.is_flagged)  # one we can dial (peerd/pairblocks.py)
            pid = chosen.peer_id if chosen is not None else ""
            if pid != d.me.sponsor:
                if pid:
                    log.warning(
                        "this peer's link is too slow for the swarm's rounds: sending our work through sponsor %s "
                        "instead; rounds no longer wait for us (outer.slow_link)",
                        pid[:8],
                    )
                elif d.me.sponsor:
                    log.info("back in the swarm's rounds (no sponsor needed or available)")
                d.me.sponsor = pid
            if d.metrics is not None:
                d.metrics.sponsored.set(1 if pid else 0)
            return pid

        return d.call(pick(), timeout=10.0)

    def upload(self, sponsor: str, vector: torch.Tensor, base_step: int, tokens: int) -> concurrent.futures.Future:
        d = self.daemon
        assert d.loop is not None

        async def send() -> pb.SponsorResponse:
            info = d.membership.get(sponsor)
            if info is None or d.channels is None:
                raise RoundFailed(f"sponsor {sponsor[:8]} is not in our table")
            net = d.cfg.network
            try:
                resp = await sponsor_upload(
                    d.channels.rounds(info.address, info), d.identity, d.run_id, d.codec, vector, base_step, tokens,
                    3 * net.rendezvous_timeout + net.round_timeout, net.chunk_bytes, d.executor,
                )  # fmt: skip
            except grpc.aio.AioRpcError as exc:
                # A sponsor we cannot dial (killed, its host gone) stays our choice until gossip calls it dead, many
                # windows later: each window's upload failed at once and we downloaded the state again (a hot loop,
                # seen at 64 peers). Counted unreachable now, the next window picks another sponsor or rejoins rounds.
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    d.membership.mark_unreachable(sponsor, why="sponsor upload failed", address=info.address)
                raise
            if resp.included_step >= 0 and d.metrics is not None:
                d.metrics.sponsored_contributions.labels(role="sent").inc()
            return resp

        return asyncio.run_coroutine_threadsafe(send(), d.loop)

    def fetch_average(self, sponsor: str, step: int, numel: int, timeout: float) -> concurrent.futures.Future:
        d = self.daemon
        assert d.loop is not None

        async def get() -> tuple[StateSnapshot, bytes]:
            info = d.membership.get(sponsor)
            if info is None or d.channels is None:
                raise RoundFailed(f"sponsor {sponsor[:8]} is not in our table")
            stub = d.channels.rounds(info.address, info)
            return await sponsor_average(stub, d.identity, d.run_id, step, numel, info.public_key, timeout)

        return asyncio.run_coroutine_threadsafe(get(), d.loop)

    def take(self, step: int, own_norm: float) -> list[SponsoredWork]:
        return self.desk.take(step, own_norm)

    def keep_average(self, step: int, average: torch.Tensor, included: int, carried: Sequence[str]) -> None:
        self.desk.keep_average(step, average, included, carried)

    def settle(self, taken: list[SponsoredWork], included_step: int | None) -> None:
        self.desk.settle(taken, included_step)
        if taken and included_step is not None and self.daemon.metrics is not None:
            self.daemon.metrics.sponsored_contributions.labels(role="carried").inc(len(taken))

    def probes(self) -> tuple[int, int]:
        return self.probe.probes, self.probe.recovered

    def close(self) -> None:
        self.desk.close()


def _with_known_steps(daemon: Daemon) -> list[pb.PeerInfo]:
    """Live peers (copies) with the newest step we know each finished: gossip, or an exchange it had with us."""
    out = []
    for p in daemon.membership.alive(include_self=False):
        q = copy_peer(p)
        q.outer_step = daemon.membership.step_of(p)
        out.append(q)
    return out


def pair_session(daemon: Daemon, numel: int) -> Pairing:
    """The NoLoCo pairing engine for this daemon, configured from its run config."""
    cfg = daemon.cfg
    settings = PairSettings(
        group_size=cfg.noloco.group_size,
        max_staleness=cfg.noloco.max_staleness,
        match_timeout=cfg.network.match_timeout,
        exchange_timeout=cfg.network.round_timeout,
        chunk_bytes=cfg.network.chunk_bytes,
        send_ahead=cfg.noloco.send_ahead,
    )
    return Pairing(
        identity=daemon.identity,
        run_id=daemon.run_id,
        verifier=daemon.verifier,
        codec=daemon.codec,
        executor=daemon.executor,
        numel=numel,
        settings=settings,
        transport=RelayTransport(daemon, GrpcTransport(lambda: daemon.channels)),
        # Proposers dial their targets: an outbound-only peer is proposed to only through its relay (peerd/relay.py)
        candidates=lambda: pair_targets(daemon, _with_known_steps(daemon)),
        lookup=daemon.membership.get,
        me=lambda: daemon.me,
        on_rejected=daemon.count_rejected,
        on_unreachable=lambda pid, how: daemon.membership.mark_unreachable(pid, why="pair dial failed", dial=how),
        note_step=daemon.membership.note_step,
        yield_s=lambda: daemon.reach.yield_to_outbound(settings.match_timeout),
    )


class DaemonSwarm:
    """The port on a running daemon: each call goes to the daemon's loop, which owns the table and the network."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def allreduce(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> RoundResult:
        return self.daemon.allreduce(step, vector, fragment, want_decoded, tokens, carries)

    def allreduce_async(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> concurrent.futures.Future:
        return self.daemon.allreduce_async(step, vector, fragment, want_decoded, tokens, carries)

    def note_members(self, step: int, peer_ids: Sequence[str]) -> None:
        loop = self.daemon.loop
        if loop is None:
            return
        ids = list(peer_ids)
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody needs the note
            loop.call_soon_threadsafe(self.daemon.membership.note_round, step, ids)

    def skip_rounds(self, step: int, fragments: Sequence[int]) -> None:
        loop, leader = self.daemon.loop, self.daemon.leader
        if loop is None or leader is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed: no round waits for us any more
            loop.call_soon_threadsafe(leader.skip, step, list(fragments))

    def canonical(self, min_step: int = -1) -> Claim | None:
        return self.daemon.canonical(min_step)

    def swarm_step(self) -> int:
        return max(self.peer_steps(), default=-1)

    def finished_step(self) -> int:
        async def newest() -> int:  # on the loop, which owns the table
            m = self.daemon.membership
            return max((e.info.outer_step for e in m.entries.values() if e.info.finished), default=-1)

        return self.daemon.call(newest(), timeout=10.0)

    def peer_steps(self) -> list[int]:
        async def steps() -> list[int]:  # on the loop, which owns the table
            return [p.outer_step for p in self.daemon.membership.alive(include_self=False)]

        return self.daemon.call(steps(), timeout=10.0)

    def fetch_state(
        self,
        min_step: int,
        expected: dict[str, tuple[int, ...]],
        timeout: float = 120.0,
        better: bool = False,
        base: dict[str, torch.Tensor] | None = None,
        parts: list[list[tuple[int, int]]] | None = None,
    ) -> StateSnapshot:
        return self.daemon.call(statefetch.fetch_state(self.daemon, min_step, expected, timeout, better, base, parts))

    def open_pairing(self, numel: int) -> PairPort:
        engine = pair_session(self.daemon, numel)
        self.daemon.pairing = engine
        return _DaemonPairing(self.daemon, engine)

    def open_sponsoring(self, numel: int) -> SponsorPort:
        d = self.daemon
        d.sponsor_desk = SponsorDesk(numel, d.codec, d.cfg.robust.max_norm_ratio, eligible=d.timing.may_be_sponsored)
        return _DaemonSponsoring(d, d.sponsor_desk)

    def record_round(
        self, group: pb.Group, result: RoundResult, fragment: int, note: str = "", rendezvous_s: float = 0.0
    ) -> None:
        self.daemon.record_round(group, result, fragment, note=note, rendezvous_s=rendezvous_s)

    def count_solo_step(self) -> None:
        self.daemon.status.solo_steps += 1

    def count_failure(self, reason: str) -> None:
        self.daemon.count_failure(reason)

    def screen_partners(
        self, mine: Mapping[str, torch.Tensor], partners: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, str]:
        return self.daemon.guard.screen_partners(mine, partners)

    def invalid_contribution(self, peer_id: str, reason: str) -> None:
        self.daemon.invalid_contribution(peer_id, reason)
