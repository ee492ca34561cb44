"""Fault injectors for tests, torchft-style: real processes misbehave on purpose, instead of mocks.

Each injector is switched on by an environment variable of the peer process and read once at import. None is on in a
normal run. Keep every injector here, so a reader sees in one place how a daemon can be made to misbehave.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sized
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

if TYPE_CHECKING:  # torch and the codecs only where an injector uses them: `peerd status` imports this module (via
    import torch  # peerd/channels.py) and must not pay torch's import (seconds on a loaded host) for it

    from peerd.codecs import Codec

T = TypeVar("T", bound=Sized)


def _env(name: str) -> str:
    return os.environ.get(name, "")


# This machine's wall clock is off by this many seconds (900: a quarter of an hour ahead), as on a volunteer's
# machine without NTP, or a dual-boot one whose hardware clock keeps local time. Every wall-clock read that peers
# compare (request timestamps, peerd/envelope.py) goes through wall().
CLOCK_OFFSET_S = float(_env("PEERD_FAULT_CLOCK_OFFSET_S") or 0)


def wall() -> float:
    """time.time() as this machine's clock reads it."""
    return time.time() + CLOCK_OFFSET_S


# Flip bytes in every encoded payload this peer sends in a round (after encoding, before signing the stream), so
# the stream checks out but the frame's checksum does not: the receiver must refuse it and the round go on without us.
CORRUPT_PAYLOADS = _env("PEERD_FAULT_CORRUPT_PAYLOADS") == "1"
# With PEERD_FAULT_CORRUPT_FROM_PART=k only a Reduce stream's parts k, k+1, ... (peerd/allreduce.py): a stream that
# goes bad after the owner already returned averaged parts.
CORRUPT_FROM_PART = int(_env("PEERD_FAULT_CORRUPT_FROM_PART") or 0)


def corrupt(payload: T, part: int = 0) -> T | bytes:
    """Flip a few bytes in the middle of an encoded frame (bytes, or a codec's SealedFrame); unchanged unless on."""
    if not CORRUPT_PAYLOADS or part < CORRUPT_FROM_PART or len(payload) < 64:
        return payload
    buf = bytearray(bytes(payload))
    mid = len(buf) // 2
    for i in range(mid, mid + 8):
        buf[i] ^= 0xFF
    return bytes(buf)


def poisoned(vector: torch.Tensor) -> torch.Tensor:
    """PEERD_FAULT_POISON=huge|nan: replace this peer's contribution by a huge or NaN one (a poisoning peer)."""
    mode = _env("PEERD_FAULT_POISON")
    if mode == "huge":
        return vector * 1e6
    if mode == "nan":
        out = vector.clone()
        out[: max(1, out.numel() // 100)] = float("nan")
        return out
    return vector


def outsized(step: int, vector: torch.Tensor) -> torch.Tensor:
    """PEERD_FAULT_OUTSIZE=STEP:LO:HI (e.g. 1:0.3:0.45): at outer step STEP this peer's contribution is 100x its work
    over that share of the vector, as an honest peer's is next to one CPU-starved owner's in lr warm-up (seen in CI:
    12x the steps, 15x the norm per claimed work). Only the owner of that part refuses it. Unlike PEERD_FAULT_POISON
    the peer runs the honest protocol."""
    spec = _env("PEERD_FAULT_OUTSIZE").split(":")
    if len(spec) != 3 or int(spec[0]) != step:
        return vector
    lo, hi = (int(float(x) * vector.numel()) for x in spec[1:])
    out = vector.clone()
    out[lo:hi] *= 100.0
    return out


def forge_frame(codec: Codec, x: torch.Tensor) -> bytes:
    """Fault injection only (a poisoning peer): frame `x` even when it holds NaN/Inf, which `encode` refuses, the
    way a hostile peer would craft it by hand: a valid uncompressed frame whose first body value is made NaN."""
    import torch

    from peerd.codecs.frame import HEADER_SIZE, TRAILER_SIZE, parse_header, seal_frame

    if bool(torch.isfinite(x).all()):
        return codec.encode(x)
    plain = copy.copy(codec)  # the same codec and parameters (block size, sparse density and bits), zstd off
    plain.zstd = False
    frame = plain.encode(torch.nan_to_num(x, nan=1.0, posinf=1.0, neginf=-1.0))
    body = bytearray(frame[HEADER_SIZE : len(frame) - TRAILER_SIZE])
    body[0:4] = b"\x00\x00\xc0\x7f"  # float32 NaN, little-endian
    return seal_frame(parse_header(frame), body)


def _delay(name: str) -> float:
    """Seconds from env var `name`, 0 when unset, unreadable or outside (0, 60)."""
    try:
        value = float(_env(name) or 0.0)
    except ValueError:
        return 0.0
    return value if 0.0 < value < 60.0 else 0.0


def step_delay() -> float:
    """PEERD_FAULT_STEP_DELAY_S=0.05: sleep this long after every inner step (a slower peer, or paced tests whose
    network faults must land mid-run however fast the machine is)."""
    return _delay("PEERD_FAULT_STEP_DELAY_S")


def start_delay() -> float:
    """PEERD_FAULT_START_DELAY_S=2: sleep this long before the first inner step (and before the start barrier): a
    peer whose model build or data load takes longer than its partners'."""
    return _delay("PEERD_FAULT_START_DELAY_S")


# Stall every state download this peer serves for this many seconds before the first chunk (a slow or hung server),
# so tests can stop a joiner while it waits in a state download.
STATE_STALL_S = float(_env("PEERD_FAULT_STATE_STALL_S") or 0)
# Only the first N downloads served stall (0: every one): a holder whose link goes silent mid-download, then comes back.
STATE_STALL_N = [int(_env("PEERD_FAULT_STATE_STALL_N") or 0)]
_STALL_EVERY = STATE_STALL_N[0] <= 0


def _spend(left: list[int]) -> bool:
    """Take one from a fault's countdown (the first N calls get the fault): True while any were left."""
    if left[0] > 0:
        left[0] -= 1
        return True
    return False


def state_stall_s() -> float:
    """Seconds to stall this download before its header (PEERD_FAULT_STATE_STALL_S, for the first
    PEERD_FAULT_STATE_STALL_N downloads or every one)."""
    return STATE_STALL_S if STATE_STALL_S and (_STALL_EVERY or _spend(STATE_STALL_N)) else 0.0


# Refuse every inbound call but Status (which the local user asks): a peer behind a NAT or firewall, simulated without
# root or namespaces. Each refused call is logged, so tests can check that nobody dials an outbound-only peer.
NO_INBOUND = _env("PEERD_FAULT_NO_INBOUND") == "1"


class _NoInbound(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        if details.method.endswith("/Status"):
            return await continuation(details)
        logging.getLogger("peerd").warning("fault: refused inbound call %s", details.method)
        return None  # the caller sees UNIMPLEMENTED


def inbound_blockers() -> list[grpc.aio.ServerInterceptor]:
    """Server interceptors of the PEERD_FAULT_NO_INBOUND injector (none unless on)."""
    return [_NoInbound()] if NO_INBOUND else []


# Exit the process (os._exit(17)) after sending this many NoLoCo exchange chunks: a real peer dies in the middle of a
# stream, the way a crash would.
EXCHANGE_EXIT_ENV = "PEERD_FAULT_EXCHANGE_EXIT_AFTER_CHUNKS"
# Exit the process after handing this many parts of its contributions to Reduce streams (peerd/allreduce.py), all
# rounds counted: a member (and shard owner) dies in the middle of a round.
REDUCE_EXIT_ENV = "PEERD_FAULT_REDUCE_EXIT_AFTER_PARTS"


class _ExitAfter:
    """Counts what this process sent, and exits after the count its environment variable names."""

    def __init__(self, env: str, what: str) -> None:
        raw = _env(env).strip()
        self.exit_after = int(raw) if raw else None
        self.what = what
        self.sent = 0
        self.claimed = 0

    def on_chunk(self) -> None:
        if self.exit_after is None:
            return
        self.sent += 1
        if self.sent >= self.exit_after:
            self._exit()

    async def claim(self) -> None:
        """Before sending one more (for streams sent concurrently): once the count is claimed, wait until those were
        handed over whole (`done`), give grpc's own threads a moment to write them, and exit: the receivers got
        exactly the count."""
        if self.exit_after is None:
            return
        if self.claimed < self.exit_after:
            self.claimed += 1
            return
        while self.sent < self.claimed:
            await asyncio.sleep(0.01)
        time.sleep(0.3)
        self._exit()

    def done(self) -> None:
        """One claimed item was handed over whole."""
        self.sent += 1

    def _exit(self) -> None:
        logging.getLogger("peerd").error("fault injection: exiting after sending %d %s", self.sent, self.what)
        logging.shutdown()
        os._exit(17)


EXCHANGE_EXIT = _ExitAfter(EXCHANGE_EXIT_ENV, "exchange chunks")
REDUCE_EXIT = _ExitAfter(REDUCE_EXIT_ENV, "reduce parts")
# An owner that exits after handing this many averaged parts to its members' streams: it dies with its shard
# delivered to some members and not to others (the window allreduce.py closes by relaying the shard).
GATHER_EXIT_ENV = "PEERD_FAULT_GATHER_EXIT_AFTER_PARTS"
GATHER_EXIT = _ExitAfter(GATHER_EXIT_ENV, "averaged parts")


class _ExitAfterAnswers(_ExitAfter):
    """A round leader that exits after answering this many Rendezvous calls with a group, before answering the rest:
    killed mid-rendezvous, it leaves some members in a round whose other owners never heard of it (seen at 64
    peers). Its own join is no call and is not counted."""

    async def answered(self) -> None:
        if self.exit_after is None:
            return
        self.sent += 1
        if self.sent > self.exit_after:
            await asyncio.sleep(0.5)  # the answers let through reach their members first
            self._exit()


LEADER_EXIT_ENV = "PEERD_FAULT_LEADER_EXIT_AFTER_ANSWERS"
LEADER_EXIT = _ExitAfterAnswers(LEADER_EXIT_ENV, "rendezvous answers")


class _FromRound:
    """A fault that holds from the round with the 0-based index its environment variable names on (all rounds this
    process took part in counted, by round id), so the first rounds hold every member."""

    def __init__(self, env: str, says: str = "", only: bool = False) -> None:
        self.start = int(_env(env).strip() or -1)
        self.says = says  # logged once, when the fault first holds
        self.only = only  # in that round alone
        self._seen: dict[bytes, int] = {}

    def __call__(self, round_id: bytes) -> bool:
        if self.start < 0:
            return False
        key = bytes(round_id)
        if key not in self._seen:
            self._seen[key] = len(self._seen)
            if self.says and self._seen[key] == self.start:
                logging.getLogger("peerd").error("fault injection: %s", self.says)
        return self._seen[key] == self.start if self.only else self._seen[key] >= self.start


# Rendezvous answers for this outer step never arrive: the call reaches the leader, which counts us in its group, and
# its answer vanishes on the way back, as a path MTU blackhole drops a full-size group list (tests/test_swarm_diloco).
RENDEZVOUS_LOST_ENV = "PEERD_FAULT_RENDEZVOUS_LOST_AT_STEP"
RENDEZVOUS_LOST_AT = int(_env(RENDEZVOUS_LOST_ENV).strip() or -1)


async def rendezvous_answer(step: int, call: Awaitable[Any]) -> Any:
    """`call`'s answer, unless the PEERD_FAULT_RENDEZVOUS_LOST_AT_STEP injector loses it: then wait for ever."""
    answer = await call
    if step == RENDEZVOUS_LOST_AT:
        await asyncio.Event().wait()
    return answer


# A member whose Reduce streams to other owners open and then carry nothing until the round's deadline: alive in
# gossip, in the group, but its contributions never come (a stuck connection, a starved process).
REDUCE_SILENT_ENV = "PEERD_FAULT_REDUCE_SILENT_FROM_ROUND"
reduce_silent = _FromRound(REDUCE_SILENT_ENV, "sending nothing on Reduce streams from this round on")

# A member whose round fails here: 1 s into the round, before it sends any contribution, and before it feeds its own
# to the shard it owns (at 2 s), while the others wait for that shard's average. As if its exchange with another
# owner had failed (a refused fallback, say): its failure must stay its own.
ROUND_FAIL_ENV = "PEERD_FAULT_ROUND_FAIL_FROM_ROUND"
round_fails = _FromRound(ROUND_FAIL_ENV)


# A member that sees shard 0's owner lost in one round (the round with this 0-based index) although it is alive: its
# exchange with that owner fails at once, as a starved loop's streams or a false gossip verdict make it, and it sends
# the shard to the next owner in line, while the members that see the owner alive finish with it.
OWNER_LOOKS_LOST_ENV = "PEERD_FAULT_SHARD0_OWNER_LOOKS_LOST_IN_ROUND"
owner_looks_lost = _FromRound(OWNER_LOOKS_LOST_ENV, "shard 0's owner looks lost to this member", only=True)


# An owner's refusal of our contribution reaches this member as the owner's stream ending while we still wrote
# (grpc then reports its own failed write, INTERNAL, not the owner's INVALID_ARGUMENT): a race that the refusal of a
# corrupt later part wins now and then. The member takes the owner for lost (peerd/allreduce.py).
REFUSAL_LOOKS_LOST = _env("PEERD_FAULT_REFUSAL_LOOKS_LOST") == "1"


# A starved process: this peer's event loop blocks for this many seconds once, as its first round begins (after the
# rendezvous, before it registers the round). Meanwhile its gRPC server picks up no new call: the members' Reduce
# streams to it queue inside gRPC, as they do on a daemon whose loop gets too little CPU (64 peers on 2 cores).
LOOP_STALL_ENV = "PEERD_FAULT_LOOP_STALL_S"
_loop_stall = [float(_env(LOOP_STALL_ENV) or 0)]


def stall_loop_once() -> None:
    """Block the calling (event-loop) thread for PEERD_FAULT_LOOP_STALL_S seconds, the first time only."""
    seconds, _loop_stall[0] = _loop_stall[0], 0.0
    if seconds > 0:
        logging.getLogger("peerd").error("fault injection: blocking the event loop for %.0f s", seconds)
        time.sleep(seconds)


# A starved peer as the others see it at 64 daemons on 2 cores: it answers every Gossip call only this many seconds
# after it arrives, and calls nobody itself, so the others hear its heartbeat only in its late answers
# (peerd/gossip.py, `Gossip.deadline`).
GOSSIP_LATE_S = float(_env("PEERD_FAULT_GOSSIP_LATE_S") or 0)


# A peer too starved to answer its dial-back in time, the first N times (as one of 64 daemons on 2 cores was): its
# first N ProbeEcho answers come 2 s late, after the prober's 1.5 s deadline, so it is judged outbound-only though
# nothing blocks it (peerd/reachability.py re-checks such a verdict).
ECHO_LATE = [int(_env("PEERD_FAULT_ECHO_LATE") or 0)]


async def echo_late() -> None:
    """Delay this ProbeEcho answer while PEERD_FAULT_ECHO_LATE has answers left to delay."""
    if _spend(ECHO_LATE):
        logging.getLogger("peerd").warning("fault injection: answering a dial-back probe 2 s late")
        await asyncio.sleep(2.0)


# A helper that does not answer a dial-back request at all, the first N times (a bootstrap peer still starting, or
# one too starved to answer): its first N Probe calls fail UNAVAILABLE, so the asker has no verdict and must ask again
# (peerd/reachability.py, RETRY_S).
PROBE_DROP = [int(_env("PEERD_FAULT_PROBE_DROP") or 0)]


def probe_drop() -> bool:
    """Fail this Probe call while PEERD_FAULT_PROBE_DROP has calls left to fail."""
    if _spend(PROBE_DROP):
        logging.getLogger("peerd").warning("fault injection: dropping a dial-back probe request")
        return True
    return False


# Streaming DiLoCo: every fragment exchange counts as landed no earlier than this many seconds after it started (the
# round itself runs normally): a slow link without a slow link.
EXCHANGE_DELAY_ENV = "PEERD_FAULT_EXCHANGE_DELAY_S"


def exchange_delay_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds from PEERD_FAULT_EXCHANGE_DELAY_S (0 when unset); only a finite number in [0, 3600] passes."""
    raw = (os.environ if environ is None else environ).get(EXCHANGE_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{EXCHANGE_DELAY_ENV} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 3600.0:
        raise ValueError(f"{EXCHANGE_DELAY_ENV} must be in [0, 3600] seconds, got {raw!r}")
    return value


# Shape this peer's upload to this many Mbit/s: every stream it sends (round contributions, averaged shards, NoLoCo
# exchanges, relayed calls, state it serves) is paced through one token bucket, so they share the rate like flows on
# one uplink. A slow link without root or tc (tests in network namespaces shape real links with tbf instead).
UPLINK_MBIT_ENV = "PEERD_FAULT_UPLINK_MBIT"


def uplink_mbit(environ: Mapping[str, str] | None = None) -> float:
    """Mbit/s from PEERD_FAULT_UPLINK_MBIT (0 when unset or not a positive finite number)."""
    raw = (os.environ if environ is None else environ).get(UPLINK_MBIT_ENV, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return value if 0.0 < value < math.inf else 0.0


UPLINK_QUANTUM = 16 * 1024  # bytes a message is paced by: concurrent messages take turns at this grain


class Uplink:
    """One token bucket for the process, shared the way a real uplink shares its rate between flows: a message of n
    bytes takes its turn quantum by quantum (UPLINK_QUANTUM) behind whatever else is waiting, so k messages in flight
    each move at about rate / k and finish together. Paced as whole messages in arrival order instead, three owners'
    parts would reach the first owner at a third of the time the link needs for all three: that owner would see a slow
    peer as prompt, which no TCP link with one flow per peer does."""

    def __init__(self, mbit: float) -> None:
        self.bytes_per_s = mbit * 1e6 / 8
        self._free_at = 0.0

    async def take(self, n: int) -> None:
        left = n
        while True:
            quantum = min(left, UPLINK_QUANTUM)
            left -= quantum
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + quantum / self.bytes_per_s
            await asyncio.sleep(self._free_at - now)
            if left <= 0:
                return

    async def pace(self, messages: Any) -> AsyncIterator[Any]:
        """Yield `messages` (a sync or async iterator) no faster than the uplink allows."""
        if hasattr(messages, "__aiter__"):
            async for msg in messages:
                await self.take(msg.ByteSize())
                yield msg
        else:
            for msg in messages:
                await self.take(msg.ByteSize())
                yield msg


class _PaceClient(grpc.aio.StreamStreamClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, uplink: Uplink) -> None:
        self.uplink = uplink

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(details, self.uplink.pace(request_iterator))

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(details, self.uplink.pace(request_iterator))


class _PaceServer(grpc.aio.ServerInterceptor):
    """Paces the responses of streaming RPCs this peer serves (averaged shards, exchanges, state downloads)."""

    def __init__(self, uplink: Uplink) -> None:
        self.uplink = uplink

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not handler.response_streaming:
            return handler
        uplink = self.uplink
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def stream_stream(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
                async for msg in uplink.pace(inner_ss(request_iterator, context)):
                    yield msg

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async for msg in uplink.pace(inner_us(request, context)):
                yield msg

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )


_UPLINK = Uplink(uplink_mbit()) if uplink_mbit() else None


def uplink_client_interceptors() -> list[Any]:
    """Client interceptors of the PEERD_FAULT_UPLINK_MBIT injector (none unless on)."""
    return [_PaceClient(_UPLINK)] if _UPLINK is not None else []


def uplink_server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Server interceptors of the PEERD_FAULT_UPLINK_MBIT injector (none unless on)."""
    if _UPLINK is None:
        return []
    logging.getLogger("peerd").warning("fault injection: upload shaped to %.3g Mbit/s", uplink_mbit())
    return [_PaceServer(_UPLINK)]
