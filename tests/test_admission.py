"""Admission control: open, shared secret, allowlist and signed invitations. A non-admitted key is refused on every
RPC with a reason and learns nothing about the swarm; an admitted one gets in."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from peerd import admission, tls
from peerd.admission import Admission, AdmissionError, Invite
from peerd.channels import CHANNEL_OPTIONS
from peerd.config import ConfigError, RunConfig
from peerd.envelope import set_admission_prover, sign
from peerd.identity import Identity
from peerd.membership import sign_entry
from peerd.streams import HEADER_METHOD
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc
from tests.swarm import REPO, Peer, Swarm, tiny_config

RUN = b"r" * 32


def _auth(ident: Identity, adm: Admission | None = None) -> pb.Auth:
    """A signed request's Auth, with `adm`'s proof in it (as the daemon's envelope.sign attaches it)."""
    set_admission_prover(ident.public_key, adm.prove if adm is not None else None)
    try:
        return sign(pb.GossipRequest(), "Gossip", ident, RUN).auth
    finally:
        set_admission_prover(ident.public_key, None)


def test_secret_mode_proves_the_secret_without_sending_it() -> None:
    secret = b"s" * 32
    adm = Admission("secret", secret=secret)
    me = Identity.generate()
    auth = _auth(me, adm)
    adm.check(auth)
    assert secret not in auth.SerializeToString()
    with pytest.raises(AdmissionError, match="join-secret"):
        adm.check(_auth(me, Admission("secret", secret=b"t" * 32)))
    with pytest.raises(AdmissionError, match="join-secret"):
        adm.check(_auth(me))
    stolen = _auth(Identity.generate(), adm)  # someone else's proof, copied onto our request
    mine = _auth(me)
    mine.admission = stolen.admission
    with pytest.raises(AdmissionError):
        adm.check(mine)
    replayed = _auth(me, adm)  # our own proof moved to a fresh nonce
    fresh = _auth(me)
    fresh.admission = replayed.admission
    with pytest.raises(AdmissionError):
        adm.check(fresh)


def test_allowlist_mode() -> None:
    inside, outside = Identity.generate(), Identity.generate()
    adm = Admission("allowlist", allowlist=[inside.public_key])
    adm.check(_auth(inside))
    with pytest.raises(AdmissionError, match="allowlist"):
        adm.check(_auth(outside))
    with pytest.raises(AdmissionError, match="not on the run's allowlist"):
        adm.check_self(outside.public_key)


def test_invitations() -> None:
    owner = Identity.generate().private_key
    owner_pub = admission._public(owner)
    guest, stranger = Identity.generate(), Identity.generate()
    now = time.time()
    invite = Invite.issue(owner, guest.public_key, int(now + 3600))
    assert Invite.from_text(invite.to_text()) == invite
    adm = Admission("invite", owner_key=owner_pub, invite=invite)
    adm.check(_auth(guest, adm))
    adm.check(_auth(guest, adm))  # cached the second time
    adm.check_self(guest.public_key)
    # The guest's invitation on a stranger's request names the wrong key.
    with pytest.raises(AdmissionError, match="another peer"):
        adm.check(_auth(stranger, adm))
    with pytest.raises(AdmissionError, match="invitation"):
        adm.check(_auth(stranger))
    # Signed by someone who is not the owner.
    fake = Invite.issue(Identity.generate().private_key, stranger.public_key, int(now + 3600))
    with pytest.raises(AdmissionError, match="owner"):
        adm.check(_auth(stranger, Admission("invite", owner_key=owner_pub, invite=fake)))
    # Expired.
    old = Invite.issue(owner, stranger.public_key, int(now - 1))
    with pytest.raises(AdmissionError, match="expired"):
        adm.check(_auth(stranger, Admission("invite", owner_key=owner_pub, invite=old)))
    with pytest.raises(AdmissionError, match="expired"):
        Admission("invite", owner_key=owner_pub, invite=old).check_self(stranger.public_key)
    with pytest.raises(AdmissionError, match="malformed"):
        Invite.decode(invite.encode()[:-1])


def test_open_mode_admits_anyone_and_modes_need_their_material() -> None:
    Admission("open").check(_auth(Identity.generate()))
    with pytest.raises(AdmissionError, match="join secret"):
        Admission("secret")
    with pytest.raises(ConfigError, match="allowlist"):
        RunConfig.from_dict({"admission": {"mode": "allowlist"}})
    with pytest.raises(ConfigError, match="owner_key"):
        RunConfig.from_dict({"admission": {"mode": "invite"}})
    with pytest.raises(ConfigError, match="allowlist"):
        RunConfig.from_dict({"admission": {"mode": "allowlist", "allowlist": ["xyz"]}})
    # Secrets are local: they never change the run id.
    a = RunConfig.from_dict({"security": {"join_secret_file": "/a"}})
    assert a.run_id() == RunConfig().run_id()


def test_secret_files_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x" * 32)
    os.chmod(path, 0o644)
    with pytest.raises(AdmissionError, match="chmod 600"):
        admission.load_join_secret(path)
    os.chmod(path, 0o600)
    assert admission.load_join_secret(path) == b"x" * 32
    path.write_bytes(b"short")
    with pytest.raises(AdmissionError, match="shorter"):
        admission.load_join_secret(path)


def _peerd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peerd", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_cli_makes_owner_keys_and_invitations(tmp_path: Path) -> None:
    out = _peerd("owner-key", str(tmp_path / "owner.key"))
    assert out.returncode == 0, out.stderr
    owner_pub = out.stdout.split('owner_key = "')[1].split('"')[0]
    assert (tmp_path / "owner.key").stat().st_mode & 0o777 == 0o600
    assert _peerd("owner-key", str(tmp_path / "owner.key")).returncode == 2  # never overwrites
    key = _peerd("key", "--data-dir", str(tmp_path / "peer"))
    peer_pub = key.stdout.split()[2]
    inv = _peerd(
        "invite", "--owner-key", str(tmp_path / "owner.key"), "--peer-key", peer_pub, "--expires", "2h",
        "--out", str(tmp_path / "invite"),
    )  # fmt: skip
    assert inv.returncode == 0, inv.stderr
    invite = admission.load_invite(tmp_path / "invite")
    invite.check(bytes.fromhex(owner_pub), bytes.fromhex(peer_pub), time.time())
    assert 7000 < invite.expires - time.time() <= 7200
    bad = _peerd("invite", "--owner-key", str(tmp_path / "owner.key"), "--peer-key", "12", "--expires", "1d")
    assert bad.returncode == 2 and "peer-key" in bad.stderr


# -- real daemons ----------------------------------------------------------------------------------------------------
def _private(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


class Run:
    """One single-peer run in a given admission mode, plus what an admitted client needs."""

    def __init__(self, peer: Peer, config: Path, prover_for: dict[bytes, admission.Admission]) -> None:
        self.peer = peer
        self.cfg = RunConfig.load(config)
        self.provers = prover_for  # public key -> policy holding that key's proof


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    tmp = tmp_path_factory.mktemp("admission")
    swarm = Swarm(tmp, 0, secure=True)
    secret = _private(tmp / "secret", os.urandom(24).hex().encode())
    owner = Identity.generate().private_key
    owner_pub = admission._public(owner)
    guest = Identity.generate()
    ids = {i: Identity.load_or_create(tmp / f"peer{i}") for i in range(4)}
    invites = {
        i: _private(
            tmp / f"invite{i}", Invite.issue(owner, ids[i].public_key, int(time.time() + 600)).to_text().encode()
        )
        for i in (2, 3)
    }
    guest_invite = Invite.issue(owner, guest.public_key, int(time.time() + 600))
    allowed = [ids[1].public_key.hex(), guest.public_key.hex()]
    specs = {
        "secret": ({"admission__mode": "secret", "security__join_secret_file": str(secret)}, 0),
        "allowlist": ({"admission__mode": "allowlist", "admission__allowlist": allowed}, 1),
        "invite": (
            {
                "admission__mode": "invite",
                "admission__owner_key": owner_pub.hex(),
                "security__invite_file": str(invites[2]),
            },
            2,
        ),
    }
    out: dict[str, Run] = {}
    for mode, (overrides, index) in specs.items():
        config = tiny_config(tmp, f"{mode}.toml", run__outer_steps=0, **overrides)
        peer = swarm.spawn(index, None, config=config, wait_peers=2)
        swarm.peers.append(peer)
        adm = {
            "secret": Admission("secret", secret=secret.read_bytes().strip()),
            "allowlist": Admission("allowlist", allowlist=[guest.public_key]),
            "invite": Admission("invite", owner_key=owner_pub, invite=guest_invite),
        }[mode]
        out[mode] = Run(peer, config, {guest.public_key: adm})
        out[mode].guest = guest  # type: ignore[attr-defined]
        out[mode].tmp = tmp  # type: ignore[attr-defined]
        out[mode].invite3 = invites[3]  # type: ignore[attr-defined]
    try:
        for run in out.values():
            run.peer.wait_file("address")
        yield out
    finally:
        for p in swarm.peers:  # nothing to keep from these peers: kill -9 is quicker than a clean leave
            p.kill()


def _dial(address: str) -> grpc.Channel:
    cert = tls.fetch_cert_sync(address)
    opts = CHANNEL_OPTIONS + tls.channel_options(tls.verify_cert(cert))
    return grpc.secure_channel(address, tls.channel_credentials(cert), options=opts)


def _requests(run: Run, ident: Identity, adm: Admission | None) -> dict[str, object]:
    """One signed request per RPC, from `ident` (with `adm`'s proof attached, if any)."""
    set_admission_prover(ident.public_key, adm.prove if adm is not None else None)
    try:
        run_id = run.cfg.run_id()
        info = pb.PeerInfo(peer_id=ident.peer_id, public_key=ident.public_key, address="127.0.0.1:9")
        sign_entry(info, run_id, ident.sign)  # as a real peer does: gossip refuses entries not signed by their subject
        tensor = pb.TensorHeader(round_id=b"r" * 32, shard=0, numel=4, codec=pb.CODEC_FP32)
        header = sign(tensor, HEADER_METHOD, ident, run_id)
        return {
            "Join": sign(pb.JoinRequest(self=info, run_spec_json=run.cfg.spec_json()), "Join", ident, run_id),
            "Gossip": sign(pb.GossipRequest(peers=[info]), "Gossip", ident, run_id),
            "Rendezvous": sign(pb.RendezvousRequest(step=0, fragment=-1), "Rendezvous", ident, run_id),
            "Start": sign(pb.StartRequest(peers=2), "Start", ident, run_id),
            "Match": sign(pb.MatchRequest(step=0, group_size=2), "Match", ident, run_id),
            "Download": sign(pb.StateRequest(min_step=0), "Download", ident, run_id),
            "Reduce": pb.TensorMessage(header=header),
            "Status": sign(pb.StatusRequest(), "Status", ident, run_id),
        }
    finally:
        set_admission_prover(ident.public_key, None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["secret", "allowlist", "invite"])
def test_non_admitted_keys_are_refused_on_every_rpc(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    stranger = Identity.generate()
    reqs = _requests(run, stranger, None)
    with _dial(run.peer.address) as ch:
        members, rounds, state = rpc.MembershipStub(ch), rpc.RoundsStub(ch), rpc.StateStub(ch)
        calls = {
            "Join": lambda: members.Join(reqs["Join"], timeout=10),
            "Gossip": lambda: members.Gossip(reqs["Gossip"], timeout=10),
            "Rendezvous": lambda: rounds.Rendezvous(reqs["Rendezvous"], timeout=10),
            "Start": lambda: rounds.Start(reqs["Start"], timeout=10),
            "Match": lambda: rounds.Match(reqs["Match"], timeout=10),
            "Download": lambda: list(state.Download(reqs["Download"], timeout=10)),
            "Reduce": lambda: list(rounds.Reduce(iter([reqs["Reduce"]]), timeout=10)),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, err.value.details())
            assert "not admitted" in err.value.details(), (name, err.value.details())
        # Status answers, but without a word about other peers (signed or not).
        for req in (pb.StatusRequest(), reqs["Status"]):
            st = members.Status(req, timeout=10)
            assert st.redacted and not st.peers and not st.alive and st.peer_id


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["secret", "allowlist", "invite"])
def test_admitted_keys_get_in(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    guest = run.guest  # type: ignore[attr-defined]
    reqs = _requests(run, guest, run.provers[guest.public_key])
    with _dial(run.peer.address) as ch:
        members = rpc.MembershipStub(ch)
        resp = members.Join(reqs["Join"], timeout=10)
        assert run.peer.status().peer_id in [p.peer_id for p in resp.peers]
        full = members.Status(reqs["Status"], timeout=10)
        assert not full.redacted and guest.peer_id in [p.peer_id for p in full.peers]


@pytest.mark.slow
def test_invited_peer_joins_and_trains_while_an_uninvited_one_is_refused(runs: dict[str, Run]) -> None:
    run = runs["invite"]
    tmp = run.tmp  # type: ignore[attr-defined]
    swarm = Swarm(tmp, 0, secure=True)
    config = tmp / "invite.toml"
    uninvited = swarm.spawn(4, run.peer.address, config=config, extra=["--invite-file", str(run.invite3)])
    guest = swarm.spawn(3, run.peer.address, config=config, wait_peers=2, extra=["--invite-file", str(run.invite3)])
    swarm.peers.append(guest)
    try:
        assert uninvited.wait(120) == 2  # its invitation names peer 3's key, not its own: refused before joining
        assert "names another peer's key" in uninvited.log()
        swarm.wait_until(
            lambda: run.peer.status().outer_step >= 1 and guest.status().outer_step >= 1, 120, "a shared round"
        )
        got = _peerd("status", run.peer.address, "--data-dir", str(tmp / "peer3"), "--invite-file", str(run.invite3))
        assert got.returncode == 0 and "withheld" not in got.stdout, got.stderr
        anonymous = _peerd("status", run.peer.address)
        assert anonymous.returncode == 0 and "withheld" in anonymous.stdout
    finally:
        for p in [*swarm.peers, uninvited]:
            p.kill()
