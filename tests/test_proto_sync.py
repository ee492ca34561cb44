"""The generated protobuf code must match proto/: editing a .proto without regenerating fails here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_matches_proto_files() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_drift_is_detected(tmp_path: Path) -> None:
    """The check itself must be able to fail: compare against a tampered copy."""
    sys.path.insert(0, str(ROOT / "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    fresh = generate.generate(tmp_path)
    target = tmp_path / fresh[0]
    committed = (ROOT / fresh[0]).read_bytes()
    assert target.read_bytes() == committed
    target.write_bytes(committed + b"\n# drift\n")
    assert target.read_bytes() != committed


def test_codec_enum_matches_the_codec_registry() -> None:
    """The proto's Codec values are the frames' own codec ids, for every codec the run config accepts."""
    from peerd.codecs import CODEC_IDS
    from peerd.config import CODECS
    from peerd.v1 import peerd_pb2 as pb
    from peerd.wire import codec_name, codec_to_wire

    assert set(CODECS) == set(CODEC_IDS)
    for name, codec_id in CODEC_IDS.items():
        assert codec_to_wire(name) == codec_id, name
        assert codec_name(codec_id) == name
    assert len(pb.Codec.values()) == len(CODEC_IDS) + 1  # and CODEC_UNSPECIFIED, which is never sent
    assert codec_name(pb.CODEC_UNSPECIFIED) == "" and codec_name(99) == ""


def test_tensor_kinds_round_trip_and_unknown_ones_are_empty() -> None:
    from peerd.pair_exchange import KINDS, MIXED_KINDS
    from peerd.v1 import peerd_pb2 as pb
    from peerd.wire import kind_name, kind_to_wire

    for name in ("reduce", "gather", "relay", "sponsored", "pull", *KINDS, *MIXED_KINDS):
        assert kind_name(kind_to_wire(name)) == name
    assert len(pb.TensorKind.values()) == 9
    assert kind_name(pb.TENSOR_KIND_UNSPECIFIED) == "" and kind_name(42) == ""


def test_the_protocol_revision_is_in_the_proto_header_and_the_run_spec() -> None:
    """Bumping the wire revision means editing both; peers of different revisions then get different run ids."""
    import re

    from peerd.config import PROTOCOL, RunConfig, spec_differences

    header = (ROOT / "proto" / "peerd" / "v1" / "peerd.proto").read_text().split("syntax")[0]
    assert re.search(rf"revision {PROTOCOL}\.", header), "proto header names another revision than config.PROTOCOL"
    assert re.search(rf"^//\s+{PROTOCOL}: ", header, re.M), "the proto header's revision list lacks this revision"
    spec = RunConfig().spec()
    assert spec["protocol"] == PROTOCOL
    assert spec_differences(spec, {**spec, "protocol": PROTOCOL - 1}) == ["protocol"]
