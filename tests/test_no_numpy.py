"""The daemon and the trainer never need numpy (volunteers' and CI's venvs may not have it; the hf extra brings it
only for transformers): import every module and run a codec round trip and a model step with numpy made
unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import importlib, pkgutil, sys
sys.modules["numpy"] = None  # any `import numpy` now raises ImportError
import peerd, trainer
skip = {"trainer.hf", "peerd.__main__"}  # transformers itself needs numpy; __main__ runs the CLI
for pkg in (peerd, trainer):
    for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if mod.name not in skip:
            importlib.import_module(mod.name)
import torch
from peerd.codecs import make_codec
from trainer.model import GPT, ModelConfig
x = torch.randn(10_000)
for name in ("fp32", "bf16", "int8", "int4", "fp8"):
    codec = make_codec(name)
    y = codec.decode(codec.encode(x), x.numel())
    assert y.shape == x.shape, name
model = GPT(ModelConfig.preset("tiny"))
idx = torch.randint(0, 256, (2, 16))
_, loss = model(idx, idx)
loss.backward()
print("ok")
"""


def test_peerd_and_trainer_run_without_numpy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
