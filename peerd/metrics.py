"""Prometheus metrics of one peer, and the HTTP endpoint that serves them plus swarm-wide service discovery.

Every daemon owns its own ``CollectorRegistry`` so that several daemons in one process (tests, ``peerd demo``)
never collide. Labels only ever take values from small fixed sets: the peer's identity reaches Prometheus as a
*target* label through ``/sd`` rather than as a metric label, so series counts stay bounded by swarm size.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv6Address, ip_address
from socket import AF_INET6
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

__all__ = [
    "FAILURE_REASONS",
    "FORMS",
    "KINDS",
    "OUTCOMES",
    "PHASES",
    "REJECT_REASONS",
    "ROUND_BUCKETS",
    "MetricsError",
    "MetricsServer",
    "PeerMetrics",
]

log = logging.getLogger(__name__)

KINDS = ("reduce", "gather", "pair", "state", "gossip", "rendezvous")
"""What a transfer carried: reduce-scatter/all-gather parts, NoLoCo pairs, state downloads, membership."""
TENSOR_KINDS = ("reduce", "gather", "pair")
"""The kinds that go through a codec: only they set peerd_compression_ratio."""
FORMS = ("raw", "wire")
"""``raw``: bytes of the fp32 tensors before encoding; ``wire``: bytes carried after quantize+zstd."""
PHASES = ("rendezvous", "exchange", "total")
OUTCOMES = ("complete", "partial", "failed", "solo")
FAILURE_REASONS = ("timeout", "peer_lost", "aborted", "resync", "state_download", "other")
REJECT_REASONS = (
    "bad_signature",
    "wrong_run",
    "malformed",
    "oversized",
    "nan",
    "replay",
    "rate_limited",
    "banned",
    "unknown_peer",
    "not_admitted",
    "unsigned",
    "forged",
    "forged_entry",
    "stale",
    "truncated",
    "timeout",
    "too_large",
    "other",
)
ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0)
"""From a loopback round (tens of ms) up to a slow internet round of a large model (minutes)."""

_MAX_SD_BYTES = 4 * 1024 * 1024
"""Refuse to serve an absurd /sd document rather than stream it; a swarm of thousands still fits easily."""


class MetricsError(ValueError):
    """A metric was fed a value outside its fixed label set, or a negative / non-finite amount."""


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise MetricsError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _check_amount(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise MetricsError(f"{name} must be finite and >= 0, got {value!r}")
    return value


class PeerMetrics:
    """All of one daemon's metrics, in its own CollectorRegistry (so several daemons/tests never collide),
    plus the default process, platform and gc collectors registered on that registry.

    Every labelled child known in advance is created at construction, so each series exists (at 0) before the
    first event: dashboards show flat lines instead of "no data", and ``rate()`` sees the first increment.
    The ``record_*`` helpers validate their input and map free-form reasons onto the bounded sets.
    """

    def __init__(self, *, algorithm: str, codec: str, run_id: str, peer_id: str, version: str) -> None:
        self.algorithm = algorithm
        self.peer_id = peer_id  # kept for logs only: it must never become a metric label
        self.registry = registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)

        # Training. Losses start as NaN: "not measured yet" must not read as a perfect loss of 0.
        self.train_loss = Gauge("peerd_train_loss", "Latest local training loss.", registry=registry)
        self.eval_loss = Gauge("peerd_eval_loss", "Latest evaluation loss.", registry=registry)
        self.train_loss.set(math.nan)
        self.eval_loss.set(math.nan)
        self.tokens_per_second = Gauge(
            "peerd_tokens_per_second",
            "Local training throughput over the last inner steps.",
            registry=registry,
        )
        self.tokens = Counter("peerd_tokens", "Tokens trained on by this peer.", registry=registry)
        self.inner_step = Gauge("peerd_inner_step", "Local inner optimizer step.", registry=registry)
        self.outer_step = Gauge("peerd_outer_step", "Outer step of the global parameters.", registry=registry)
        self.learning_rate = Gauge("peerd_learning_rate", "Current inner learning rate.", registry=registry)

        # Communication.
        self.sent_bytes = Counter(
            "peerd_sent_bytes",
            "Payload bytes sent, before (raw) and after (wire) encoding.",
            ["kind", "form"],
            registry=registry,
        )
        self.sent_messages = Counter(
            "peerd_sent_messages",
            "Messages sent (gossip requests and answers, stream parts, ...).",
            ["kind"],
            registry=registry,
        )
        self.received_bytes = Counter(
            "peerd_received_bytes",
            "Payload bytes received, as decoded (raw) and as carried (wire).",
            ["kind", "form"],
            registry=registry,
        )
        self.compression_ratio = Gauge(
            "peerd_compression_ratio", "Raw over wire bytes of the last exchange sent.", registry=registry
        )
        self.compression_ratio.set(math.nan)
        self.round_duration = Histogram(
            "peerd_round_duration_seconds",
            "Duration of round phases.",
            ["algorithm", "phase"],
            buckets=ROUND_BUCKETS,
            registry=registry,
        )
        self.round_peers = Gauge(
            "peerd_round_peers", "Peers whose contributions the last round included.", registry=registry
        )
        self.rounds = Counter("peerd_rounds", "Rounds by outcome.", ["algorithm", "outcome"], registry=registry)
        self.failures = Counter("peerd_failures", "Round or sync failures by reason.", ["reason"], registry=registry)
        self.checkpoint_failures = Counter(
            "peerd_checkpoint_failures",
            "Checkpoint writes that failed (disk full, read-only); the previous checkpoint stays.",
            registry=registry,
        )
        self.rejected_messages = Counter(
            "peerd_rejected_messages",
            "Messages from the network refused, by reason.",
            ["reason"],
            registry=registry,
        )

        # Membership.
        self.known_peers = Gauge("peerd_known_peers", "Peers in this peer's membership table.", registry=registry)
        self.alive_peers = Gauge(
            "peerd_alive_peers", "Peers seen alive recently, this one included.", registry=registry
        )
        self.undialable_peers = Gauge(
            "peerd_undialable_peers",
            "Live peers this peer cannot dial although others hear them (a route broken between two hosts only): "
            "they lead no round and own no shard.",
            registry=registry,
        )
        self.clock_offset = Gauge(
            "peerd_clock_offset_seconds",
            "Correction this peer applies to its own clock to sign by the swarm's time (0: its clock is right).",
            registry=registry,
        )
        self.source_changes = Counter(
            "peerd_source_address_changes",
            "Times the address this machine sends from went away (a new lease, a move): every connection was renewed.",
            registry=registry,
        )
        self.expected_peers = Gauge(
            "peerd_expected_peers",
            "Peers the run expects in a round: live, or seen live within network.forget_after (this one included).",
            registry=registry,
        )
        self.alone = Gauge(
            "peerd_training_alone",
            "1 while this peer takes outer steps with no other peer (a split, or everyone else gone).",
            registry=registry,
        )
        self.loop_stall = Counter(
            "peerd_loop_stall_seconds",
            "Seconds this daemon's event loop ran late (starved or busy); not counted towards peers' silence.",
            registry=registry,
        )
        self.state_downloads = Counter(
            "peerd_state_downloads",
            "Times this peer adopted another peer's state, by why: behind, fork (lost the split-brain rule), start.",
            ["why"],
            registry=registry,
        )
        self.steps_sat_out = Counter(
            "peerd_steps_sat_out",
            "Outer steps this peer sat out because an owner's checks refused its contribution (its norm screen, or "
            "data that did not decode); each is also a failed round. Its work carries into the next round.",
            registry=registry,
        )
        self.redials = Counter(
            "peerd_redials",
            "Dials of dead peers and bootstrap addresses (network.redial_max backoff).",
            registry=registry,
        )
        self.work = Gauge(
            "peerd_state_work",
            "Peer-rounds behind this peer's global state (the split-brain rule's weight).",
            registry=registry,
        )
        self.reachable = Gauge(
            "peerd_reachable",
            "1: other peers can dial this one (its dial-back probe passed, or was not run yet); 0: outbound-only.",
            registry=registry,
        )
        self.reachable.set(1)
        self.flagged_peers = Gauge(
            "peerd_flagged_peers",
            "Peers a majority of the swarm flags from their timings (slow: late, slow streams or little work; faulty: "
            "blamed for failed rounds); they neither lead rounds nor own shards until they recover.",
            ["kind"],
            registry=registry,
        )
        self.self_flagged = Gauge(
            "peerd_self_flagged",
            "1 while a majority of the swarm flags this peer (by kind): see its log for why.",
            ["kind"],
            registry=registry,
        )
        for kind in ("slow", "faulty"):
            self.flagged_peers.labels(kind=kind).set(0)
            self.self_flagged.labels(kind=kind).set(0)
        self.rendezvous_answers = Counter(
            "peerd_rendezvous_answers",
            "Groups this peer sent as a round's leader, by form: delta (changes from the member's previous member "
            "list) or whole (peerd/group_delta.py).",
            ["form"],
            registry=registry,
        )
        for form in ("delta", "whole"):
            self.rendezvous_answers.labels(form=form)
        self.sponsored = Gauge(
            "peerd_sponsored",
            "1 while this peer's link is too slow for rounds and its work goes through a sponsor (peerd/sponsor.py).",
            registry=registry,
        )
        self.sponsored_contributions = Counter(
            "peerd_sponsored_contributions",
            "Sponsored contributions in completed rounds, by role: sent (ours, through a sponsor) or carried (a slow "
            "peer's, in our contribution).",
            ["role"],
            registry=registry,
        )
        for role in ("sent", "carried"):
            self.sponsored_contributions.labels(role=role)
        self.relayed_bytes = Counter(
            "peerd_relayed_bytes",
            "Bytes this peer relayed between other peers (outbound-only peers).",
            registry=registry,
        )

        # Compute.
        self.compute_idle_seconds = Counter(
            "peerd_compute_idle_seconds",
            "Wall time the trainer spent blocked on communication.",
            registry=registry,
        )
        self.info = Info("peerd", "Build and run of this peer.", registry=registry)
        self.info.info({"version": version, "algorithm": algorithm, "codec": codec, "run_id": run_id})

        for kind in KINDS:
            self.sent_messages.labels(kind=kind)
            for form in FORMS:
                self.sent_bytes.labels(kind=kind, form=form)
                self.received_bytes.labels(kind=kind, form=form)
        for phase in PHASES:
            self.round_duration.labels(algorithm=algorithm, phase=phase)
        for outcome in OUTCOMES:
            self.rounds.labels(algorithm=algorithm, outcome=outcome)
        for reason in FAILURE_REASONS:
            self.failures.labels(reason=reason)
        for reason in REJECT_REASONS:
            self.rejected_messages.labels(reason=reason)
        for why in ("behind", "fork", "start"):
            self.state_downloads.labels(why=why)

    def record_sent(self, kind: str, raw_bytes: int, wire_bytes: int, messages: int = 1) -> None:
        """Count one outgoing transfer; also sets the compression ratio, since that is the codec's effect."""
        _check_choice("kind", kind, KINDS)
        raw, wire = _check_amount("raw_bytes", raw_bytes), _check_amount("wire_bytes", wire_bytes)
        self.sent_bytes.labels(kind=kind, form="raw").inc(raw)
        self.sent_bytes.labels(kind=kind, form="wire").inc(wire)
        self.sent_messages.labels(kind=kind).inc(max(int(messages), 0))
        if wire > 0 and kind in TENSOR_KINDS:  # membership traffic has no raw form: it must not reset the ratio
            self.compression_ratio.set(raw / wire)

    def record_received(self, kind: str, raw_bytes: int, wire_bytes: int) -> None:
        """Count one incoming transfer."""
        _check_choice("kind", kind, KINDS)
        raw, wire = _check_amount("raw_bytes", raw_bytes), _check_amount("wire_bytes", wire_bytes)
        self.received_bytes.labels(kind=kind, form="raw").inc(raw)
        self.received_bytes.labels(kind=kind, form="wire").inc(wire)

    def record_round(
        self,
        outcome: str,
        *,
        peers: int,
        total_seconds: float,
        rendezvous_seconds: float | None = None,
        exchange_seconds: float | None = None,
    ) -> None:
        """Record a finished round: its outcome, how many peers it included and how long its phases took."""
        _check_choice("outcome", outcome, OUTCOMES)
        if isinstance(peers, bool) or not isinstance(peers, int) or peers < 0:
            raise MetricsError(f"peers must be an int >= 0, got {peers!r}")
        phases = {"rendezvous": rendezvous_seconds, "exchange": exchange_seconds, "total": total_seconds}
        checked = {p: _check_amount(f"{p}_seconds", s) for p, s in phases.items() if s is not None}
        for phase, seconds in checked.items():
            self.round_duration.labels(algorithm=self.algorithm, phase=phase).observe(seconds)
        self.rounds.labels(algorithm=self.algorithm, outcome=outcome).inc()
        self.round_peers.set(peers)

    def record_flags(self, timing: Any) -> None:
        """The swarm's timing verdicts (peerd/timings.SwarmTimings): how many peers are flagged, and whether we are."""
        for kind, peers in timing.flagged.items():
            self.flagged_peers.labels(kind=kind).set(len(peers))
            self.self_flagged.labels(kind=kind).set(1 if timing.me.peer_id in peers else 0)

    def record_failure(self, reason: str) -> None:
        """Count a failure; reasons outside FAILURE_REASONS count as ``other`` to keep labels bounded."""
        self.failures.labels(reason=reason if reason in FAILURE_REASONS else "other").inc()

    def record_rejected(self, reason: str) -> None:
        """Count a refused message; reasons outside REJECT_REASONS are counted as ``other``."""
        self.rejected_messages.labels(reason=reason if reason in REJECT_REASONS else "other").inc()

    def record_idle(self, seconds: float) -> None:
        """Add time the trainer waited on the network (the numerator of the compute-idle fraction)."""
        self.compute_idle_seconds.inc(_check_amount("seconds", seconds))

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


class _Handler(BaseHTTPRequestHandler):
    """Serves one request; the owning server carries the metrics and the SD callback."""

    server: _Server
    timeout = 10  # a stalled client must not pin a thread forever
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            self._reply(HTTPStatus.OK, CONTENT_TYPE_LATEST, self.server.metrics.render())
        elif path == "/sd":
            self._serve_sd()
        else:
            self._reply(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found; try /metrics or /sd\n")

    def _serve_sd(self) -> None:
        try:
            body = json.dumps(_validate_sd(self.server.sd_targets()), allow_nan=False).encode()
        except Exception as exc:  # the callback is the daemon's; a bug there must not kill the metrics server
            log.warning("service discovery callback failed: %s", exc)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", b"sd unavailable\n")
            return
        if len(body) > _MAX_SD_BYTES:
            log.warning("service discovery document of %d bytes refused", len(body))
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", b"sd too large\n")
            return
        self._reply(HTTPStatus.OK, "application/json", body)

    def _reply(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics http %s: " + format, self.address_string(), *args)


def _validate_sd(groups: object) -> list[dict]:
    """Check the daemon's targets against the HTTP SD shape so Prometheus never gets a document it rejects."""
    if not isinstance(groups, list):
        raise MetricsError("sd_targets() must return a list")
    for group in groups:
        if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
            raise MetricsError("each SD group must be a dict with a 'targets' list")
        if not all(isinstance(t, str) and t for t in group["targets"]):
            raise MetricsError("SD targets must be non-empty 'host:port' strings")
        labels = group.get("labels", {})
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise MetricsError("SD labels must map strings to strings")
    return groups


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], metrics: PeerMetrics, sd_targets: Callable[[], list[dict]]):
        self.metrics = metrics
        self.sd_targets = sd_targets
        super().__init__(address, _Handler)


class _Server6(_Server):
    address_family = AF_INET6


class MetricsServer:
    """HTTP server on its own thread serving /metrics (exposition format) and /sd (Prometheus HTTP SD JSON).

    ``/sd`` lets one Prometheus, pointed at any single peer, discover and scrape the whole swarm.
    """

    def __init__(self, metrics: PeerMetrics, host: str, port: int, sd_targets: Callable[[], list[dict]]) -> None:
        if not 0 <= port <= 65535:
            raise MetricsError(f"port must be in 0..65535, got {port}")
        self.metrics = metrics
        self.host = host
        self.port = port
        self.sd_targets = sd_targets
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound port (port 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("MetricsServer already started")
        host = self.host.strip("[]")
        try:
            v6 = isinstance(ip_address(host), IPv6Address)
        except ValueError:  # a host name: let the resolver pick, IPv4 socket
            v6 = False
        cls = _Server6 if v6 else _Server
        self._server = cls((host, self.port), self.metrics, self.sd_targets)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="peerd-metrics",
            daemon=True,
        )
        self._thread.start()
        return int(self._server.server_address[1])

    def stop(self) -> None:
        """Stop serving and release the port; safe to call twice or before start()."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
