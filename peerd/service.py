"""gRPC servicers: turn RPCs into calls on the daemon, and every bad request into a clear status code plus a count.

Handlers never let a malformed or hostile request escape as an unhandled exception: it is refused with a status and a
message that says why, counted by reason, and the daemon goes on serving.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from peerd.allreduce import RoundFailed
from peerd.codecs import CodecError
from peerd.config import spec_differences
from peerd.envelope import AuthError
from peerd.statesync import state_messages
from peerd.streams import StreamError, verify_header
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc

if TYPE_CHECKING:
    from peerd.daemon import Daemon

MAX_SPEC_JSON = 64 * 1024


class MembershipService(rpc.MembershipServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        try:
            sender = self.d.verifier.verify("Join", request, check_run=False)
        except AuthError as exc:
            await self.d.refuse(context, exc.reason, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if request.auth.run_id != self.d.run_id:
            await self.d.refuse(context, "wrong_run", grpc.StatusCode.FAILED_PRECONDITION, self._spec_mismatch(request))
        if request.self.peer_id != sender or request.self.public_key != request.auth.public_key:
            await self.d.refuse(
                context,
                "forged",
                grpc.StatusCode.PERMISSION_DENIED,
                "Join: the peer info does not belong to the signing key",
            )
        await self.d.admit(request, context)
        joiner = pb.PeerInfo()
        joiner.CopyFrom(request.self)
        observed = _observed_host(context.peer())
        if _unspecified(joiner.address) and observed:
            joiner.address = f"{observed}:{joiner.address.rsplit(':', 1)[-1]}"
        self.d.adopt_address(request.dialed_address)
        self.d.membership.merge([joiner])
        self.d.log(f"peer {sender[:8]} joined from {request.self.address}")
        return pb.JoinResponse(
            run_id=self.d.run_id,
            peers=self.d.membership.gossip_view(),
            observed_address=observed,
        )

    def _spec_mismatch(self, request: pb.JoinRequest) -> str:
        mine = json.loads(self.d.cfg.spec_json())
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
        return f"run spec differs from this run's: {named}. Use the same run.toml as the other peers."

    async def Gossip(self, request: pb.GossipRequest, context: grpc.aio.ServicerContext) -> pb.GossipResponse:
        await self.d.verify(request, "Gossip", context)
        self.d.membership.merge(request.peers)
        return pb.GossipResponse(peers=self.d.membership.gossip_view())

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        sender = await self.d.verify(request, "Leave", context)
        if request.self.peer_id == sender:
            self.d.membership.mark_left(request.self)
            self.d.log(f"peer {sender[:8]} left")
        return pb.LeaveResponse()

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return self.d.status_message()


class RoundsService(rpc.RoundsServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def Rendezvous(
        self, request: pb.RendezvousRequest, context: grpc.aio.ServicerContext
    ) -> pb.RendezvousResponse:
        sender = await self.d.verify(request, "Rendezvous", context)
        info = self.d.membership.get(sender)
        if info is None:
            await self.d.refuse(
                context, "unknown_peer", grpc.StatusCode.FAILED_PRECONDITION, "Rendezvous: unknown peer; Join first"
            )
        return await self.d.lead_rendezvous(request, info)

    async def Reduce(
        self, request_iterator: AsyncIterator[pb.TensorMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TensorMessage]:
        it = request_iterator.__aiter__()
        rnd = None
        try:
            first = await it.__anext__()
            if first.WhichOneof("part") != "header":
                raise StreamError("malformed", "Reduce: stream must start with a header")
            sender = verify_header(self.d.verifier, first.header)
            rnd = await self.d.wait_round(first.header.round_id)
            if rnd is None:
                raise StreamError("unknown_round", "Reduce: no such round here")
            async for msg in rnd.serve(_prepend(first, it), self.d.verifier, sender):
                yield msg
        except StopAsyncIteration:
            await self.d.refuse(context, "truncated", grpc.StatusCode.INVALID_ARGUMENT, "Reduce: empty stream")
        except (StreamError, CodecError) as exc:
            reason = getattr(exc, "reason", "malformed")
            sender = getattr(exc, "sender", None)
            if rnd is not None and sender is not None and sender in rnd.ids:
                rnd.abort(RoundFailed(f"bad contribution from {sender[:8]}: {exc}", {sender}, "malformed"))
                self.d.suspect(sender, reason)
            await self.d.refuse(context, reason, grpc.StatusCode.INVALID_ARGUMENT, f"Reduce: {exc}")
        except RoundFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"round failed: {exc}")
        except TimeoutError:
            await context.abort(grpc.StatusCode.ABORTED, "round timed out")

    async def Match(self, request: pb.MatchRequest, context: grpc.aio.ServicerContext) -> pb.MatchResponse:
        sender = await self.d.verify(request, "Match", context)
        return await self.d.answer_match(request, sender)

    async def Exchange(
        self, request_iterator: AsyncIterator[pb.TensorMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TensorMessage]:
        try:
            async for msg in self.d.serve_exchange(request_iterator):
                yield msg
        except (StreamError, CodecError) as exc:
            await self.d.refuse(
                context, getattr(exc, "reason", "malformed"), grpc.StatusCode.INVALID_ARGUMENT, f"Exchange: {exc}"
            )
        except RoundFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"exchange failed: {exc}")


class StateService(rpc.StateServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def Download(
        self, request: pb.StateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StateMessage]:
        await self.d.verify(request, "Download", context)
        snap = self.d.snapshot
        if snap is None or snap.step < request.min_step:
            have = -1 if snap is None else snap.step
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"state at step >= {request.min_step} not here (have {have})"
            )
        for msg in state_messages(snap, self.d.identity, self.d.cfg.network.chunk_bytes):
            self.d.count_sent("state", len(msg.chunk), len(msg.chunk))
            yield msg


async def _prepend(first: pb.TensorMessage, rest: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
    yield first
    async for msg in rest:
        yield msg


def _unspecified(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("", "0.0.0.0", "::")


def _observed_host(peer: str) -> str:
    """'ipv4:1.2.3.4:5678' or 'ipv6:[::1]:5678' -> the host part the joiner was seen from."""
    if peer.startswith("ipv4:"):
        return peer[5:].rsplit(":", 1)[0]
    if peer.startswith("ipv6:"):
        return peer[5:].rsplit(":", 1)[0].strip("[]")
    return ""
