"""`peerd status HOST:PORT`: ask one peer for its view of the run and print it as text or JSON."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from peerd import tls
from peerd.channels import CHANNEL_OPTIONS
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc


def fetch_status(
    address: str,
    timeout: float = 5.0,
    *,
    insecure: bool | None = None,
    identity: Any = None,
    prover: Any = None,
) -> pb.StatusResponse:
    """One Status RPC over a short-lived channel (this runs outside any daemon).

    `address` may be PEERID@HOST:PORT to pin the peer. `insecure`: True dials plaintext; False requires TLS (the
    certificate is read on first contact and must carry a valid peer binding); None uses TLS when the peer speaks
    it and plaintext otherwise (an --insecure peer). With `identity` (and `prover`, a function filling
    Auth.admission) the request is signed, so a non-open run shows the full view to an admitted peer.
    """
    pinned, address = tls.parse_bootstrap(address)
    cert = b""
    if insecure is not True:
        try:
            cert = tls.fetch_cert_sync(address, timeout)
        except tls.TlsError:
            if insecure is False or pinned is not None:
                raise
        if cert:
            pid = tls.verify_cert(cert)
            if pinned is not None and pid != pinned:
                raise tls.TlsError(f"{address} is peer {pid}, not {pinned}")
    if cert:
        opts = CHANNEL_OPTIONS + tls.channel_options(tls.verify_cert(cert))
        ch = grpc.secure_channel(address, tls.channel_credentials(cert), options=opts)
    else:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    with ch:
        stub = rpc.MembershipStub(ch)
        resp = stub.Status(pb.StatusRequest(), timeout=timeout)
        if identity is None or not resp.redacted:
            return resp
        from peerd.envelope import set_admission_prover, sign

        set_admission_prover(identity.public_key, prover)
        req = sign(pb.StatusRequest(), "Status", identity, bytes.fromhex(resp.run_id))
        return stub.Status(req, timeout=timeout)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64}


def _ints(d: Any, desc: Any) -> Any:
    """MessageToDict writes 64-bit ints as strings (for JavaScript); make them numbers again for our JSON users."""
    if isinstance(d, list):
        return [_ints(x, desc) for x in d]
    if not isinstance(d, dict):
        return d
    for f in desc.fields:
        if f.name not in d:
            continue
        if f.type in _INT64:
            d[f.name] = [int(v) for v in d[f.name]] if isinstance(d[f.name], list) else int(d[f.name])
        elif f.message_type is not None:
            d[f.name] = _ints(d[f.name], f.message_type)
    return d


def status_dict(st: pb.StatusResponse) -> dict[str, Any]:
    d = MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    d = _ints(d, pb.StatusResponse.DESCRIPTOR)
    for key in ("loss", "eval_loss"):  # JSON has no NaN: report an unknown loss as null
        if isinstance(d.get(key), str) or (isinstance(d.get(key), float) and not math.isfinite(d[key])):
            d[key] = None
    for p in d.get("peers", []):
        p.pop("public_key", None)
        p.pop("state_digest", None)
    return d


def format_status(st: pb.StatusResponse) -> str:
    alive = set(st.alive)
    lines = [
        f"run        {st.run_id[:16]}  ({st.algorithm}, codec {st.codec})",
        f"peer       {st.peer_id[:16]}  at {st.address}  [{st.state}]",
        f"reach      {st.reachability or 'not reported'}"
        + (f"; relayed {st.relayed_bytes / 1e6:.2f} MB for outbound-only peers" if st.relayed_bytes else ""),
        f"step       outer {st.outer_step}, inner {st.inner_step}",
        f"loss       train {st.loss:.4f}, eval {st.eval_loss:.4f}, {st.tokens_per_second:.0f} tokens/s",
        f"traffic    sent {st.bytes_sent_raw / 1e6:.2f} MB raw, {st.bytes_sent_wire / 1e6:.2f} MB on the wire; "
        f"received {st.bytes_received_wire / 1e6:.2f} MB",
        f"health     {st.rounds_partial} partial rounds, {st.rounds_failed} failed"
        + (f" ({st.steps_sat_out} steps sat out: our contribution refused)" if st.steps_sat_out else "")
        + ", "
        f"{st.rejected_messages} rejected messages, {st.solo_steps} solo steps",
        f"state      {st.work} peer-rounds of work; adopted another peer's state {st.state_downloads} times "
        f"({st.forks_healed} of them replacing a forked state of ours)",
    ]
    if st.algorithm == "ensemble":
        lines.append("ensemble   an independent expert on its own data: no parameter exchange, by design")
    if st.alone_since:
        lines.append(f"ALONE      training alone: no reachable peers since {st.alone_since}")
    if st.rejected_contributions or st.banned:
        lines.append(
            f"security   {st.rejected_contributions} contributions refused; banned: "
            + (" ".join(b[:8] for b in st.banned) or "none")
        )
    if st.redacted:
        lines.append("peers      withheld: this run is not open (sign with --data-dir as an admitted peer)")
    busy = st.compute_seconds + st.compute_idle_seconds
    if busy > 0:
        lines.append(f"idle       {st.compute_idle_seconds:.1f}s of {busy:.1f}s ({st.compute_idle_seconds / busy:.1%})")
    lines.append(f"peers      {len(alive)} alive of {len(st.peers)} known; the run expects {len(st.expected)}")
    flags = swarm_flags([p for p in st.peers if p.peer_id in alive])
    # peers some live peer cannot dial (peerd/pairblocks.py), by id prefix -> who says so
    undialable = {x: v.peer_id[:8] for v in st.peers if v.peer_id in alive for x in v.unreachable}
    for p in sorted(st.peers, key=lambda p: p.peer_id):
        mark = "alive" if p.peer_id in alive else ("left" if p.left else "dead")
        mark += ", outbound-only" if p.outbound_only else ""
        who = undialable.get(p.peer_id[:16])
        mark += f", UNDIALABLE from {who} (no leading, no shards)" if who else ""
        mark += f", FLAGGED {flags[p.peer_id]} (no leading, no shards)" if p.peer_id in flags else ""
        mark += f", SPONSORED by {p.sponsor[:8]} (its work comes through it)" if p.sponsor else ""
        lines.append(f"  {p.peer_id[:16]}  {p.address:<22} step {p.outer_step:<5} {mark}")
    if st.HasField("last_round"):
        r = st.last_round
        tag = _tag(r)
        lines.append(
            f"last round, to outer step {r.step + 1}: {tag}, {len(r.included)}/{len(r.expected)} peers, "
            f"{r.wire_bytes / 1e6:.2f} MB wire ({r.raw_bytes / 1e6:.2f} MB raw), {r.seconds:.2f}s"
            + (f", {r.note}" if r.note else "")
        )
        lines.append("  included " + " ".join(i[:8] for i in r.included))
    if len(st.recent_rounds) > 1:
        lines.append("recent rounds (each named by the outer step it completed, as the peers' logs name them)")
        for r in list(st.recent_rounds)[-8:]:
            frag = f" fragment {r.fragment}" if r.fragment >= 0 else ""
            tag = "" if _tag(r) == "complete" else f" {_tag(r)}"
            note = f"  ({r.note})" if r.note else ""
            lines.append(
                f"  step {r.step + 1:<5}{frag} with {' '.join(i[:8] for i in r.included)}{tag}  "
                f"{r.wire_bytes / 1e6:.2f} MB  {r.seconds:.2f}s{note}"
            )
    return "\n".join(lines)


def _tag(r: pb.RoundSummary) -> str:
    """A round of one is SOLO, never "1/1 complete"; a round short of whom the run expected is PARTIAL."""
    if len(set(r.included)) <= 1:
        return "SOLO"
    return "PARTIAL" if r.partial else "complete"


def _signer(data_dir: str | None, join_secret_file: str | None, invite_file: str | None) -> tuple[Any, Any]:
    """(identity, admission prover) for a signed Status request, from a peer's data dir and admission files."""
    if not data_dir:
        return None, None
    from peerd import admission
    from peerd.identity import Identity

    identity = Identity.load_or_create(data_dir)
    if join_secret_file:
        secret = admission.load_join_secret(join_secret_file)
        return identity, lambda auth: admission.secret_proof(secret, auth)
    if invite_file:
        blob = admission.load_invite(invite_file).encode()
        return identity, lambda auth: blob
    return identity, None


def print_status(
    address: str,
    *,
    as_json: bool,
    timeout: float,
    insecure: bool | None = None,
    data_dir: str | None = None,
    join_secret_file: str | None = None,
    invite_file: str | None = None,
) -> int:
    try:
        identity, prover = _signer(data_dir, join_secret_file, invite_file)
        st = fetch_status(address, timeout, insecure=insecure, identity=identity, prover=prover)
    except grpc.RpcError as exc:
        print(f"peerd: cannot get status from {address}: {exc.code().name} {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # unreachable, not TLS / wrong peer (TlsError), unusable key files
        print(f"peerd: cannot get status from {address}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status_dict(st), sort_keys=True) if as_json else format_status(st))
    return 0


def swarm_flags(alive: list[pb.PeerInfo]) -> dict[str, str]:
    """Peers a strict majority of the other live peers flag from their timings (the daemon's own rule,
    peerd/timings.py), as peer id -> "slow" or "faulty"."""
    # imported here: peerd/robust.py imports torch, which `peerd status` must not wait on
    from peerd.robust import majority_suspects

    out: dict[str, str] = {}
    for kind in ("slow", "faulty"):
        for pid in majority_suspects({p.peer_id: list(getattr(p, kind)) for p in alive}):
            out[pid] = kind
    return out
