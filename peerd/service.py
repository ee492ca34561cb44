"""gRPC servicers: turn RPCs into calls on the daemon's parts, and every bad request into a clear status code plus a
count.

Handlers never let a malformed or hostile request escape as an unhandled exception: it is refused with a status and a
message that says why, counted by reason (peerd/checks.py), and the daemon goes on serving. Each servicer is handed
the few collaborators it needs (request checks, the peer table, gossip, the round client, the state we serve), not
the daemon: this module does not import peerd/daemon.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, NoReturn, Protocol

import grpc

from peerd import faults
from peerd.addresses import remote_ip
from peerd.allreduce import RoundFailed, suspects_metadata
from peerd.bootstrap import unspecified
from peerd.codecs import CodecError
from peerd.config import spec_differences
from peerd.envelope import AuthError
from peerd.identity import peer_id_of
from peerd.limits import LimitExceeded, paced
from peerd.roundtypes import REASON_KEY, WRONG_PEER
from peerd.statesync import StateSnapshot, check_ranges, state_messages
from peerd.streams import StreamError, prepend, verify_header
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc
from peerd.wire import kind_name

if TYPE_CHECKING:
    from peerd.checks import RequestChecks
    from peerd.config import RunConfig
    from peerd.gossip import Gossip
    from peerd.identity import Identity
    from peerd.membership import Membership
    from peerd.reachability import Reachability
    from peerd.roundclient import RoundClient
    from peerd.sponsor import SponsorDesk
    from peerd.startbarrier import StartBarrier

log = logging.getLogger("peerd")
MAX_SPEC_JSON = 64 * 1024
AVERAGE_WAIT_S = 30.0  # RoundAverage without a deadline: how long it waits for our trainer to publish the state


class PairEndpoint(Protocol):
    """NoLoCo's side of the Rounds service (the daemon routes it to its pairing engine, if it runs one)."""

    async def answer_match(self, request: pb.MatchRequest, sender: str) -> pb.MatchResponse: ...

    def serve_exchange(self, messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]: ...


class MembershipService(rpc.MembershipServicer):
    def __init__(
        self,
        *,
        checks: RequestChecks,
        membership: Membership,
        gossip: Gossip,
        reach: Reachability,
        cfg: RunConfig,
        run_id: bytes,
        status: Callable[[bool], pb.StatusResponse],
        count_sent: Callable[[str, int, int], None],
    ) -> None:
        """`status(redact)` builds this peer's StatusResponse (peerd/localstatus.py)."""
        self.count_sent = count_sent
        self.checks = checks
        self.membership = membership
        self.gossip = gossip
        self.reach = reach
        self.cfg = cfg
        self.run_id = run_id
        self.status = status

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        try:
            sender = self.checks.verifier.verify("Join", request, check_run=False)
        except AuthError as exc:
            await self.checks.refuse(context, exc.reason, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if request.auth.run_id != self.run_id:
            await self.checks.refuse(
                context, "wrong_run", grpc.StatusCode.FAILED_PRECONDITION, self._spec_mismatch(request)
            )
        if request.self.peer_id != sender or request.self.public_key != request.auth.public_key:
            await self.checks.refuse(
                context,
                "forged",
                grpc.StatusCode.PERMISSION_DENIED,
                "Join: the peer info does not belong to the signing key",
            )
        await self.checks.admit(request, context)
        observed = _observed_host(context)
        self.gossip.adopt_address(request.dialed_address)
        # The joiner's entry is signed by the joiner, so we store it as sent. One that does not know its address yet
        # learns it from `observed_address` below and gossips a re-signed entry moments later.
        if not unspecified(request.self.address):
            self.gossip.merge_gossip([request.self])
        log.info("peer %s joined from %s", sender[:8], request.self.address)
        return pb.JoinResponse(
            run_id=self.run_id,
            peers=self.membership.gossip_view(),
            observed_address=observed,
        )

    def _spec_mismatch(self, request: pb.JoinRequest) -> str:
        mine = json.loads(self.cfg.spec_json())
        try:
            if len(request.run_spec_json) > MAX_SPEC_JSON:
                raise ValueError("too large")
            theirs = json.loads(request.run_spec_json)
            if not isinstance(theirs, dict):
                raise ValueError("not an object")
            fields = spec_differences(mine, theirs)
        except ValueError:
            fields = []
        named = ", ".join(fields) if fields else "(the joiner did not send a readable spec)"
        if "protocol" in fields:
            return (
                f"run spec differs from this run's: {named}. The peers run peerd releases that speak different wire "
                f"protocol revisions (this peer: {mine.get('protocol')}); run the same peerd release as the others."
            )
        return f"run spec differs from this run's: {named}. Use the same run.toml as the other peers."

    async def Gossip(self, request: pb.GossipRequest, context: grpc.aio.ServicerContext) -> pb.GossipResponse:
        await self.checks.verify(request, "Gossip", context)
        if request.to and request.to != self.membership.self_id:
            # The caller dialled an address that belonged to another peer (it died; we took its port): merging its
            # view would make it count that peer alive, and join two swarms that only met through a reused port.
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this address now serves peer {self.membership.self_id[:8]}, not {request.to[:8]}",
                ((REASON_KEY, WRONG_PEER),),
            )
        if faults.GOSSIP_LATE_S:
            await asyncio.sleep(faults.GOSSIP_LATE_S)
        self.gossip.merge_gossip(request.peers)
        observed = _observed_host(context)
        resp = pb.GossipResponse(
            peers=self.membership.gossip_view(limit=self.cfg.network.gossip_entries), observed_address=observed
        )
        self.count_sent("gossip", 0, resp.ByteSize())
        return resp

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        sender = await self.checks.verify(request, "Leave", context)
        if request.self.peer_id == sender:
            self.membership.mark_left(request.self)
            log.info("peer %s left", sender[:8])
        return pb.LeaveResponse()

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        """Open runs answer anyone. Other runs show the peer list only to a request signed by an admitted peer: a
        refused client learns this peer's own counters, not who else is in the swarm."""
        full = self.checks.admission.open
        if not full and request.HasField("auth"):
            try:
                self.checks.verifier.verify("Status", request)
                full = True
            except AuthError as exc:
                self.checks.count_rejected(exc.reason)
        return self.status(not full)

    async def Probe(self, request: pb.ProbeRequest, context: grpc.aio.ServicerContext) -> pb.ProbeResponse:
        """Dial the sender back at its address (peerd/reachability.py)."""
        sender = await self.checks.verify(request, "Probe", context)
        if faults.probe_drop():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fault injection: probe dropped")
        return await self.reach.serve_probe(request, sender, context.peer())

    async def ProbeEcho(self, request: pb.ProbeEchoRequest, context: grpc.aio.ServicerContext) -> pb.ProbeEchoResponse:
        await faults.echo_late()
        signature = self.reach.echo(request)
        if signature is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "ProbeEcho: no probe of ours in flight uses this nonce")
        return pb.ProbeEchoResponse(signature=signature)


class RoundsService(rpc.RoundsServicer):
    def __init__(
        self,
        *,
        checks: RequestChecks,
        membership: Membership,
        rounds: RoundClient,
        pair: PairEndpoint,
        cfg: RunConfig,
        barrier: StartBarrier,
        count_sent: Callable[[str, int, int], None],
        desk: Callable[[], SponsorDesk | None] = lambda: None,
        executor: Executor | None = None,
        identity: Identity | None = None,
        published: Callable[[], tuple[int, bytes]] = lambda: (-1, b""),
    ) -> None:
        """`desk()`: where sponsored work goes (None until a DiLoCo trainer opened one). `published()`: the step and
        digest of the state we serve (RoundAverage names the one a round's average produced)."""
        self.count_sent = count_sent
        self.desk = desk
        self.identity = identity
        self.published = published
        self.executor = executor
        self.checks = checks
        self.membership = membership
        self.rounds = rounds
        self.pair = pair
        self.cfg = cfg
        self.barrier = barrier

    async def Rendezvous(
        self, request: pb.RendezvousRequest, context: grpc.aio.ServicerContext
    ) -> pb.RendezvousResponse:
        sender = await self.checks.verify(request, "Rendezvous", context)
        info = self.membership.get(sender)
        if info is None:
            await self.checks.refuse(
                context, "unknown_peer", grpc.StatusCode.FAILED_PRECONDITION, "Rendezvous: unknown peer; Join first"
            )
        resp = await self.rounds.lead_rendezvous(request, info)
        if resp.WhichOneof("result") in ("group", "delta"):
            await faults.LEADER_EXIT.answered()
        self.count_sent("rendezvous", 0, resp.ByteSize())  # the leader's answers: the group, to every member
        return resp

    async def Start(self, request: pb.StartRequest, context: grpc.aio.ServicerContext) -> pb.StartResponse:
        sender = await self.checks.verify(request, "Start", context)
        if self.membership.get(sender) is None:
            await self.checks.refuse(
                context, "unknown_peer", grpc.StatusCode.FAILED_PRECONDITION, "Start: unknown peer; Join first"
            )
        timeout = self.cfg.network.rendezvous_timeout
        left = context.time_remaining()
        timeout = timeout if left is None else min(left, timeout)
        started = await self.barrier.arrive(sender, request.peers, max(timeout - 0.2, 0.0))
        return pb.StartResponse(started=started)

    async def Reduce(
        self, request_iterator: AsyncIterator[pb.TensorMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TensorMessage]:
        # Every message must arrive within read_timeout (slow-loris); limits are charged to the verified sender.
        it = paced(request_iterator, self.checks.limits.read_timeout).__aiter__()
        rnd = None
        verified: str | None = None
        first: pb.TensorMessage | None = None
        try:
            first = await it.__anext__()
            if first.WhichOneof("part") != "header":
                raise StreamError("malformed", "Reduce: stream must start with a header")
            verified = sender = verify_header(self.checks.verifier, first.header)
            key = f"key:{sender}"
            self.checks.limits.check_rate(key)
            to = first.header.to_incarnation
            if to and to != self.membership.me.incarnation:
                # Our previous process was in that round: we never will be, so do not hold the stream for it (the
                # sender moves the shard to its fallback at once, and learns we restarted).
                await context.abort(grpc.StatusCode.NOT_FOUND, "Reduce: this peer restarted since the round formed")
            with self.checks.limits.stream(key), self.checks.limits.inflight(key, first.header.wire_bytes):
                rnd = await self.rounds.wait_round(first.header.round_id, sender)
                if rnd is None:  # the member takes us for a lost owner: the shard moves to the next in line
                    await context.abort(grpc.StatusCode.NOT_FOUND, "Reduce: this peer is not in that round")
                h = first.header
                async for msg in rnd.serve(
                    prepend(first, it), self.checks.verifier, sender, h.shard, kind_name(h.kind)
                ):
                    yield msg
        except StopAsyncIteration:
            await self.checks.refuse(context, "truncated", grpc.StatusCode.INVALID_ARGUMENT, "Reduce: empty stream")
        except LimitExceeded as exc:
            await self.checks.refuse(context, exc.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, f"Reduce: {exc}")
        except (StreamError, CodecError) as exc:
            reason = getattr(exc, "reason", "malformed")
            if first is None and reason == "timeout":  # its first part came too late: the sender sends it again
                self.checks.count_rejected(reason)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Reduce: {exc}")
            sender = getattr(exc, "sender", None) or (verified if reason == "timeout" else None)
            if reason in ("banned", "not_admitted"):
                if first is not None:  # a round of ours holding a peer we refuse cannot complete: fail it now
                    self.rounds.fail_round_with(first.header.round_id, peer_id_of(first.header.auth.public_key), reason)
                await self.checks.refuse(context, reason, grpc.StatusCode.PERMISSION_DENIED, f"Reduce: {exc}")
            if rnd is not None and sender is not None and sender in rnd.ids:
                # A stream that broke off or stalled (the member's round failed elsewhere, it died, or it is a slow
                # loris) fails nobody's round: the shard's owner dropped it (shard_owner.ShardOwner.serve).
                if reason != "truncated":
                    self.checks.suspect(sender, reason)
                if reason not in ("truncated", "timeout"):
                    rnd.abort(RoundFailed(f"bad contribution from {sender[:8]}: {exc}", {sender}, "malformed"))
            tag = ((REASON_KEY, reason[:64]),)  # the sender learns its data was refused, not that we were lost
            await self.checks.refuse(context, reason, grpc.StatusCode.INVALID_ARGUMENT, f"Reduce: {exc}", tag)
        except RoundFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"round failed: {exc}", suspects_metadata(exc))
        except TimeoutError:
            await context.abort(grpc.StatusCode.ABORTED, "round timed out")

    async def Sponsor(
        self, request_iterator: AsyncIterator[pb.TensorMessage], context: grpc.aio.ServicerContext
    ) -> pb.SponsorResponse:
        """Hold a slow-link peer's pseudo-gradient for our next round (peerd/sponsor.py) and answer once that round
        included it. Checked like a Reduce stream; the sender's upload may take many seconds, its chunks not."""
        desk = self.desk()
        if desk is None:
            await self.checks.refuse(
                context, "not_sponsor", grpc.StatusCode.FAILED_PRECONDITION,
                "Sponsor: this peer runs no DiLoCo rounds to carry sponsored work in; choose another sponsor",
            )  # fmt: skip
        it = paced(request_iterator, self.checks.limits.read_timeout).__aiter__()
        try:
            first = await it.__anext__()
            if first.WhichOneof("part") != "header":
                raise StreamError("malformed", "Sponsor: stream must start with a header")
            sender = verify_header(self.checks.verifier, first.header)
            key = f"key:{sender}"
            self.checks.limits.check_rate(key)
            if self.membership.get(sender) is None:
                await self.checks.refuse(
                    context, "unknown_peer", grpc.StatusCode.FAILED_PRECONDITION, "Sponsor: unknown peer; Join first"
                )
            refusal = desk.accepting(sender)
            if refusal is not None:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if refusal.later else grpc.StatusCode.FAILED_PRECONDITION
                await self.checks.refuse(context, "sponsor_refused", code, f"Sponsor: {refusal.text}")
            with self.checks.limits.stream(key), self.checks.limits.inflight(key, first.header.wire_bytes):
                work = await desk.receive(prepend(first, it), self.checks.verifier, self.executor, sender)
        except StopAsyncIteration:
            await self.checks.refuse(context, "truncated", grpc.StatusCode.INVALID_ARGUMENT, "Sponsor: empty stream")
        except LimitExceeded as exc:
            await self.checks.refuse(context, exc.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sponsor: {exc}")
        except (StreamError, CodecError) as exc:
            await self._refuse_stream(context, "", exc)
        desk.hold(work)
        log.info("holding %s's sponsored work (from step %d) for our next round", work.peer_id[:8], work.base_step)
        left = context.time_remaining()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(work.answer), None if left is None else max(left - 1, 0))
        except (TimeoutError, asyncio.CancelledError):
            desk.withdraw(work)  # its sender stopped waiting: it will send this work again, elsewhere
            raise

    async def RoundAverage(
        self, request: pb.AverageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StateMessage]:
        """The average of our round that carried the caller's sponsored work, with the digest of the state it
        produced here, so the caller takes the outer step itself (peerd/sponsored.py) at half a state download."""
        sender = await self.checks.verify(request, "RoundAverage", context)
        try:
            self.checks.limits.check_rate(f"key:{sender}")
        except LimitExceeded as exc:
            await self.checks.refuse(context, exc.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, f"RoundAverage: {exc}")
        desk = self.desk()
        kept = desk.average_for(request.step, sender) if desk is not None else None
        if kept is None or self.identity is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"RoundAverage: no average of a round for step {request.step} that carried your work here; "
                "download the state instead",
            )
        # Our trainer publishes the state the average produced once it evaluated it: wait for that, while the
        # caller does (it downloads the state if we never do)
        left = context.time_remaining()
        deadline = time.monotonic() + (AVERAGE_WAIT_S if left is None else max(left - 1.0, 0.0))
        step, digest = self.published()
        while step <= kept.step and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            step, digest = self.published()
        if step != kept.step + 1:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"RoundAverage: our state is at step {step}, not {kept.step + 1}; download the state instead",
            )
        snap = StateSnapshot(kept.step, {"average": kept.average}, kept.included)
        for msg in state_messages(snap, self.identity, self.cfg.network.chunk_bytes, next_digest=digest):
            self.count_sent("state", len(msg.chunk), len(msg.chunk))
            yield msg

    async def _refuse_stream(
        self, context: grpc.aio.ServicerContext, prefix: str, exc: StreamError | CodecError
    ) -> NoReturn:
        """A malformed tensor stream, or one from a sender we refuse (banned, not admitted), with its reason."""
        reason = getattr(exc, "reason", "malformed")
        code = grpc.StatusCode.PERMISSION_DENIED if reason in ("banned", "not_admitted") else None
        await self.checks.refuse(context, reason, code or grpc.StatusCode.INVALID_ARGUMENT, f"{prefix}{exc}")

    async def Match(self, request: pb.MatchRequest, context: grpc.aio.ServicerContext) -> pb.MatchResponse:
        sender = await self.checks.verify(request, "Match", context)
        return await self.pair.answer_match(request, sender)

    async def Exchange(
        self, request_iterator: AsyncIterator[pb.TensorMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TensorMessage]:
        # Exchange streams may pause while the pair waits on each other, but never longer than the exchange itself.
        limit = self.cfg.network.round_timeout + 5.0
        bounded = paced(request_iterator, limit, first_timeout=limit)
        try:
            async for msg in self.pair.serve_exchange(bounded):
                yield msg
        except (StreamError, CodecError) as exc:
            await self._refuse_stream(context, "Exchange: ", exc)
        except RoundFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"exchange failed: {exc}")


class StateService(rpc.StateServicer):
    def __init__(
        self,
        *,
        checks: RequestChecks,
        identity: Identity,
        cfg: RunConfig,
        snapshot: Callable[[], StateSnapshot | None],
        count_sent: Callable[[str, int, int], None],
    ) -> None:
        """`snapshot()` is the state we serve now (the daemon's latest `publish`)."""
        self.checks = checks
        self.identity = identity
        self.cfg = cfg
        self.snapshot = snapshot
        self.count_sent = count_sent

    async def Download(
        self, request: pb.StateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StateMessage]:
        await self.checks.verify(request, "Download", context)
        snap = self.snapshot()
        if snap is None or snap.step < request.min_step:
            have = -1 if snap is None else snap.step
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"state at step >= {request.min_step} not here (have {have})"
            )
        ranges = None
        if request.ranges:
            sizes = {t.numel() for t in snap.tensors.values()}
            try:
                if len(sizes) != 1:
                    raise StreamError("malformed", "this state's tensors differ in size: ask for whole tensors")
                ranges = check_ranges(list(request.ranges), sizes.pop())
            except StreamError as exc:
                await self.checks.refuse(context, exc.reason, grpc.StatusCode.INVALID_ARGUMENT, f"Download: {exc}")
        stall = faults.state_stall_s()
        if stall:
            log.warning("fault injection: stalling a state download for %.0fs", stall)
            await asyncio.sleep(stall)
        for msg in state_messages(snap, self.identity, self.cfg.network.chunk_bytes, ranges):
            self.count_sent("state", len(msg.chunk), len(msg.chunk))
            yield msg


def _observed_host(context: grpc.aio.ServicerContext) -> str:
    """The host a caller was seen from ('' when unknown), as peers dial it: '1.2.3.4', 'fd77::2'."""
    ip = remote_ip(context.peer())
    return str(ip) if ip is not None else ""
