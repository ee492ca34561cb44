"""Bad requests to a real daemon are refused with a clear error, and the daemon keeps serving."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peerd.config import RunConfig
from peerd.envelope import sign
from peerd.identity import Identity
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc
from tests.swarm import Swarm, tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("refusals")
    swarm = Swarm(tmp, 1, tiny_config(tmp, run__outer_steps=0))
    swarm.start()
    p = swarm.peers[0]
    p.config = RunConfig.load(swarm.config)
    p.swarm = swarm
    yield p
    swarm.stop()


def _still_serving(peer) -> None:
    with grpc.insecure_channel(peer.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert peer.proc.poll() is None


def _call(peer, fn):
    with grpc.insecure_channel(peer.address) as ch, pytest.raises(grpc.RpcError) as err:
        fn(ch)
    return err.value


def test_join_with_a_different_run_spec_names_the_fields(peer, tmp_path: Path) -> None:
    other = tiny_config(tmp_path, "other.toml", inner__lr=0.5, codec__name="int4", run__outer_steps=1)
    joiner = peer.swarm.spawn(7, peer.address, config=other)
    assert joiner.proc.wait(60) != 0
    log = joiner.log()
    assert "run spec differs" in log and "inner.lr" in log and "codec.name" in log, log
    _still_serving(peer)


def test_join_from_another_protocol_revision_says_to_run_the_same_release(peer) -> None:
    import hashlib
    import json

    from peerd.membership import sign_entry

    spec = peer.config.spec()
    spec["protocol"] -= 1  # what a peer of the previous release sends
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    run_id = hashlib.sha256(text.encode()).digest()
    ident = Identity.generate()
    info = pb.PeerInfo(peer_id=ident.peer_id, public_key=ident.public_key, address="127.0.0.1:9", heartbeat=1)
    sign_entry(info, run_id, ident.sign)
    req = sign(pb.JoinRequest(self=info, run_spec_json=text), "Join", ident, run_id)
    err = _call(peer, lambda ch: rpc.MembershipStub(ch).Join(req, timeout=5))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol" in err.details() and "same peerd release" in err.details(), err.details()
    _still_serving(peer)


def test_forged_signature_and_impersonation_are_refused(peer) -> None:
    run_id = peer.config.run_id()
    me, victim = Identity.generate(), Identity.generate()
    # A gossip message signed by one key but claiming another's public key.
    req = sign(pb.GossipRequest(), "Gossip", me, run_id)
    req.auth.public_key = victim.public_key
    err = _call(peer, lambda ch: rpc.MembershipStub(ch).Gossip(req, timeout=5))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "signature" in err.details()
    # A correctly signed Join whose peer info is someone else's.
    info = pb.PeerInfo(peer_id=victim.peer_id, public_key=victim.public_key, address="127.0.0.1:1")
    join = sign(pb.JoinRequest(self=info, run_spec_json=peer.config.spec_json()), "Join", me, run_id)
    err = _call(peer, lambda ch: rpc.MembershipStub(ch).Join(join, timeout=5))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    # The same valid request sent twice: the second is a replay.
    ok = sign(pb.GossipRequest(), "Gossip", me, run_id)
    with grpc.insecure_channel(peer.address) as ch:
        rpc.MembershipStub(ch).Gossip(ok, timeout=5)
    err = _call(peer, lambda ch: rpc.MembershipStub(ch).Gossip(ok, timeout=5))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "replay" in err.details()
    _still_serving(peer)


def test_malformed_and_oversized_chunks_are_refused(peer) -> None:
    run_id = peer.config.run_id()
    me = Identity.generate()
    # A stream that starts with a chunk instead of a header.
    err = _call(peer, lambda ch: list(rpc.RoundsStub(ch).Reduce(iter([pb.TensorMessage(chunk=b"x" * 10)]), timeout=5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in err.details()
    # A message larger than the 4 MiB limit.
    big = pb.TensorMessage(chunk=os.urandom(5 << 20))
    err = _call(peer, lambda ch: list(rpc.RoundsStub(ch).Reduce(iter([big]), timeout=10)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A header whose signature does not match.
    header = sign(
        pb.TensorHeader(round_id=b"r" * 32, shard=0, numel=10, codec=pb.CODEC_FP32), "peerd.v1.TensorHeader", me, run_id
    )
    header.numel = 1 << 40  # tampered after signing
    err = _call(peer, lambda ch: list(rpc.RoundsStub(ch).Reduce(iter([pb.TensorMessage(header=header)]), timeout=5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "signature" in err.details()
    # State download by an unsigned caller.
    err = _call(peer, lambda ch: list(rpc.StateStub(ch).Download(pb.StateRequest(), timeout=5)))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    _still_serving(peer)
    assert peer.status().rejected_messages >= 3


def test_a_stream_for_a_previous_process_is_answered_at_once(peer) -> None:
    """A Reduce stream names the incarnation the round's group lists for its owner: a restarted owner says so at
    once (NOT_FOUND, which the sender takes as a lost owner) instead of holding the stream for a round its previous
    process was in, as it holds one for a round it may yet join (its own rendezvous answer may come after a member's
    stream). At 64 peers under churn, such held streams timed whole rounds out."""
    run_id = peer.config.run_id()
    me = Identity.generate()

    def stream(to: int) -> grpc.RpcError:
        header = pb.TensorHeader(round_id=os.urandom(32), shard=0, numel=10, codec=pb.CODEC_FP32, to_incarnation=to)
        msg = pb.TensorMessage(header=sign(header, "peerd.v1.TensorHeader", me, run_id))
        return _call(peer, lambda ch: list(rpc.RoundsStub(ch).Reduce(iter([msg]), timeout=3)))

    err = stream(1)  # an incarnation no process of this peer ever had: the one the round knew is gone
    assert err.code() == grpc.StatusCode.NOT_FOUND and "restarted" in err.details(), err.details()
    # Unchecked (no incarnation named): a peer with no rendezvous in flight (this one runs no rounds) can be in no
    # group it does not know, so it says so at once too. One whose rendezvous is in flight holds the stream
    # (tests/test_wait_round.py): its answer may come after a member's stream.
    err = stream(0)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "not in that round" in err.details(), err.details()
    _still_serving(peer)
