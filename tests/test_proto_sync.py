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
