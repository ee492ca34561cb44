"""Resource limits, so one peer's flood or stall cannot starve the others: request rates, concurrent streams,
buffered bytes, and per-message read deadlines.

Limits are keyed by what is known at each point. Before a request's envelope is checked, only the connection is
known (``context.peer()``): a server interceptor rate-limits and caps concurrent calls per connection, and per
remote IP for non-loopback addresses (on loopback every local process shares 127.0.0.1, so only the connection
key is used). After the envelope checks out, the daemon charges the *verified* sender key: it cannot be charged to
an honest peer by someone who merely names its key, because unsigned or forged requests are refused first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc

from peerd.addresses import host_block, remote_ip
from peerd.config import SecuritySection
from peerd.streams import StreamError

T = TypeVar("T")
MAX_KEYS = 16384  # buckets kept; the least recently used are forgotten (a forgotten key starts with a full bucket)
IP_FACTOR = 4  # an IP may carry a few peers (NAT): its budget is this many peers' worth
HEADER_TIMEOUT_S = 10.0  # a stream must send its first message within this (or read_timeout if smaller)

SERVER_OPTIONS = [
    ("grpc.max_concurrent_streams", 128),  # per HTTP/2 connection
    # Peers' channels send keepalive pings every 30 s (channels.py). Accept pings every 10 s, even in the middle of a
    # long transfer on a slow link, without counting strikes: a GOAWAY there resets a round's streams.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_connection_idle_ms", 300_000),
    # gRPC cancels a call that waited this long for the server to pick it up (default 30 s), and the caller sees a bare
    # CANCELLED. A daemon's loop starved of CPU picks calls up slowly, so members' Reduce streams to it were cancelled
    # and their rounds failed (the largest class of failed attempts at 64 peers under churn). Each call's own
    # deadline still bounds its wait, and grpc.server_max_pending_requests (1000) the queue.
    ("grpc.server_max_unrequested_time_in_server", 600),
]


class LimitExceeded(ValueError):
    """A peer went over one of its budgets. `reason` is a metric label."""

    def __init__(self, message: str, reason: str = "rate_limited") -> None:
        super().__init__(message)
        self.reason = reason


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def take(self, now: float, cost: float = 1.0) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


class PeerLimits:
    """Budgets per key (a verified peer id, a connection, or an IP). Used from the daemon's event loop only."""

    def __init__(
        self,
        rate: float,
        burst: float,
        max_streams: int,
        max_inflight_bytes: int,
        read_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_streams = max_streams
        self.max_inflight_bytes = max_inflight_bytes
        self.read_timeout = read_timeout
        self.clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._streams: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self.refused = 0

    @classmethod
    def from_config(cls, sec: SecuritySection) -> PeerLimits:
        return cls(
            sec.rate_limit,
            sec.rate_burst,
            sec.max_streams_per_peer,
            int(sec.max_inflight_mb_per_peer * (1 << 20)),
            sec.read_timeout,
        )

    # -- budgets ------------------------------------------------------------------------------------------------
    def allow(self, key: str, factor: float = 1.0) -> bool:
        """Take one request from `key`'s bucket; False (and counted) when it is empty."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate * factor, self.burst * factor, now)
            if len(self._buckets) > MAX_KEYS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        if bucket.take(now):
            return True
        self.refused += 1
        return False

    def check_rate(self, key: str) -> None:
        if not self.allow(key):
            raise LimitExceeded(f"rate limit of {self.rate:g} requests/s exceeded")

    @contextlib.contextmanager
    def stream(self, key: str, factor: int = 1) -> Iterator[None]:
        """Hold one of `key`'s concurrent-stream slots for the duration of the block."""
        limit = self.max_streams * factor
        if self._streams.get(key, 0) >= limit:
            self.refused += 1
            raise LimitExceeded(f"more than {limit} concurrent streams")
        self._streams[key] = self._streams.get(key, 0) + 1
        try:
            yield
        finally:
            self._release(self._streams, key, 1)

    @contextlib.contextmanager
    def inflight(self, key: str, nbytes: int) -> Iterator[None]:
        """Reserve `nbytes` of `key`'s buffered-bytes budget (checked before anything is allocated)."""
        held = self._bytes.get(key, 0)
        if held + nbytes > self.max_inflight_bytes:
            self.refused += 1
            raise LimitExceeded(
                f"{held + nbytes} bytes in flight would exceed the {self.max_inflight_bytes} allowed per peer",
                "oversized",
            )
        self._bytes[key] = held + nbytes
        try:
            yield
        finally:
            self._release(self._bytes, key, nbytes)

    @staticmethod
    def _release(table: dict[str, int], key: str, amount: int) -> None:
        left = table.get(key, 0) - amount
        if left > 0:
            table[key] = left
        else:
            table.pop(key, None)

    def streams_open(self, key: str) -> int:
        return self._streams.get(key, 0)

    # -- the server interceptor ---------------------------------------------------------------------------------
    def interceptor(self, on_refused: Callable[[str], None] | None = None) -> grpc.aio.ServerInterceptor:
        return _LimitInterceptor(self, on_refused)

    def connection_keys(self, peer: str) -> list[tuple[str, int]]:
        """(key, budget factor) pairs a call from `peer` (context.peer()) is charged to."""
        keys = [(f"conn:{peer}", 1)]
        ip = remote_ip(peer)
        if ip is not None and not ip.is_loopback:
            keys.append((f"ip:{host_block(ip)}", IP_FACTOR))
        return keys


class LogThrottle:
    """At most `per_window` log lines per key per `window_s`: a flood of refused requests must not become a flood
    of log lines (disk, CPU). Returns how many were suppressed since the last line that got through."""

    def __init__(self, per_window: int = 10, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self._state: dict[str, list[float]] = {}  # key -> [window start, lines in window, suppressed]

    def allow(self, key: str) -> tuple[bool, int]:
        now = self.clock()
        st = self._state.setdefault(key, [now, 0, 0])
        if now - st[0] >= self.window_s:
            st[0], st[1] = now, 0
        if st[1] < self.per_window:
            st[1] += 1
            suppressed, st[2] = int(st[2]), 0
            return True, suppressed
        st[2] += 1
        return False, 0


class _Malformed:
    """Stands in for a request that did not parse, so the handler can refuse it (gRPC would log a traceback)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything else a parser may raise on hostile bytes
            return _Malformed(exc)

    return parse


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, _Malformed):
            raise StreamError("malformed", f"a stream message does not parse: {item.error}")
        yield item


class _LimitInterceptor(grpc.aio.ServerInterceptor):
    """Charges every call to its connection (and IP) before the handler parses anything of it, and refuses
    requests that do not parse with INVALID_ARGUMENT (counted) instead of an unhandled-exception traceback."""

    def __init__(self, limits: PeerLimits, on_refused: Callable[[str], None] | None) -> None:
        self.limits = limits
        self.on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        parse, out = _lenient(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary), parse, out)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._streaming(handler.unary_stream), parse, out)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, True), parse, out)
        return grpc.stream_stream_rpc_method_handler(self._streaming(handler.stream_stream, True), parse, out)

    async def _admit(self, request: Any, context: grpc.aio.ServicerContext) -> list[tuple[str, int]]:
        keys = self.limits.connection_keys(context.peer())
        for key, factor in keys:
            if not self.limits.allow(key, factor):
                await self._refuse(context, "rate limit exceeded")
        if isinstance(request, _Malformed):
            await self._refuse(context, f"request does not parse: {request.error}", "malformed")
        return keys

    async def _refuse(self, context: grpc.aio.ServicerContext, message: str, reason: str = "rate_limited") -> None:
        if self.on_refused is not None:
            self.on_refused(reason)
        code = grpc.StatusCode.INVALID_ARGUMENT if reason == "malformed" else grpc.StatusCode.RESOURCE_EXHAUSTED
        await context.abort(code, message)

    async def _hold_stream_slots(
        self, request: Any, context: grpc.aio.ServicerContext, stack: contextlib.ExitStack
    ) -> None:
        """Admit the call, then hold one concurrent-call slot per key it is charged to until `stack` closes."""
        keys = await self._admit(request, context)
        try:
            for key, factor in keys:
                stack.enter_context(self.limits.stream(key, 4 * factor))
        except LimitExceeded as exc:
            await self._refuse(context, str(exc))

    def _unary(self, behavior: Callable[..., Awaitable[Any]], streamed: bool = False) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if streamed:
                request = _checked(request)
            with contextlib.ExitStack() as stack:
                await self._hold_stream_slots(request, context, stack)
                return await behavior(request, context)

        return wrapped

    def _streaming(
        self, behavior: Callable[..., AsyncIterator[Any]], streamed: bool = False
    ) -> Callable[..., AsyncIterator[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if streamed:
                request = _checked(request)
            with contextlib.ExitStack() as stack:
                await self._hold_stream_slots(request, context, stack)
                async for item in behavior(request, context):
                    yield item

        return wrapped


async def paced(messages: AsyncIterator[T], timeout: float, first_timeout: float | None = None) -> AsyncIterator[T]:
    """Re-yield `messages`, failing with StreamError('timeout') when the next one takes longer than `timeout`
    (slow-loris: a peer that sends a header and stalls must not hold a stream, its buffer, or a round, for long).
    The first message gets `first_timeout` (default: the shorter of `timeout` and HEADER_TIMEOUT_S)."""
    it = messages.__aiter__()
    wait = min(timeout, HEADER_TIMEOUT_S) if first_timeout is None else first_timeout
    while True:
        try:
            item = await asyncio.wait_for(it.__anext__(), wait)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise StreamError("timeout", f"the stream sent nothing for {wait:.0f}s") from None
        yield item
        wait = timeout
