"""Regenerate peerd/v1/*_pb2*.py from proto/peerd/v1/*.proto.

Usage: python proto/generate.py [--check]

With --check it generates into a temporary directory and exits 1 if the committed files differ, so CI catches a .proto
edited without regenerating (tests/test_proto_sync.py runs the same check).
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PACKAGE = Path("peerd") / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) for every .proto file; return the generated files relative to out_root."""
    from grpc_tools import protoc  # dev dependency; imported here so the daemon never needs it

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "peerd" / "v1").glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / OUT_PACKAGE).glob("*_pb2*"))


def drift() -> list[str]:
    """Names of generated files that differ from (or are missing in) the repo."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(p.relative_to(ROOT) for p in (ROOT / OUT_PACKAGE).glob("*_pb2*"))
        bad = [str(p) for p in fresh if not (ROOT / p).exists() or not filecmp.cmp(Path(tmp) / p, ROOT / p, False)]
        bad += [str(p) for p in committed if p not in fresh]
        return bad


def main() -> None:
    if "--check" in sys.argv:
        bad = drift()
        if bad:
            print("generated protobuf code is out of date: " + ", ".join(bad))
            print("run: python proto/generate.py")
            raise SystemExit(1)
        print("generated protobuf code is in sync")
        return
    for p in generate(ROOT):
        print("wrote", p)


if __name__ == "__main__":
    main()
