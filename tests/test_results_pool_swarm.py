"""Round results from the pool (peerd/codecs/hostmem.py) in real daemons: two processes average a vector big enough
for the pool three times, and each keeps every result. A buffer handed out again while a caller held it would show
as an earlier round's result turning into a later one's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from peerd.codecs import hostmem

REPO = Path(__file__).resolve().parent.parent
NUMEL = hostmem.HUGE_FROM_BYTES // 4 + 100_000  # just past the pool's threshold
ROUNDS = 3

_WORKER = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    import torch
    from peerd.codecs import hostmem
    from peerd.config import RunConfig
    from peerd.daemon import Daemon
    from peerd.identity import Identity
    from peerd.statesync import StateSnapshot
    index, numel, rounds, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    net = {"gossip_interval": 0.3, "peer_timeout": 5.0, "rendezvous_timeout": 8.0, "round_timeout": 60.0}
    cfg = RunConfig.from_dict({"codec": {"name": "fp32"}, "network": net})
    d = Daemon(cfg, Identity.load_or_create(out.parent / f"peer{index}"), listen="127.0.0.1:0", bootstrap=sys.argv[5:],
               data_dir=out.parent / f"peer{index}", insecure=True)
    d.start()
    d.wait_for_peers(2, threading.Event(), timeout=60)
    base = torch.randn(numel, generator=torch.Generator().manual_seed(index))
    held, pooled = [], []
    for step in range(rounds):
        if step:
            d.publish(StateSnapshot(step, {}))
        held.append(d.allreduce(step, base + step).average)  # every result kept, as a caller may
        pooled.append(hostmem.RESULTS.kept_bytes())
    torch.save(held, out.with_suffix(".pt"))
    out.write_text(json.dumps({"pooled": pooled}))
    time.sleep(2.0)  # the other may still be reading its last parts from us
    d.stop()
    """
)


def test_results_held_across_rounds_stay_their_own(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs, logs = [], []
    for i in range(2):
        boot = [(tmp_path / "peer0" / "address").read_text().strip()] if i else []
        log = open(tmp_path / f"log{i}", "w")  # noqa: SIM115 - closed below
        argv = [sys.executable, "-c", _WORKER, str(i), str(NUMEL), str(ROUNDS), str(tmp_path / f"r{i}.json"), *boot]
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        logs.append(log)
        if i == 0:
            deadline = time.monotonic() + 60
            while not (tmp_path / "peer0" / "address").exists():
                assert time.monotonic() < deadline and procs[0].poll() is None, "first peer did not start"
                time.sleep(0.05)
    try:
        for p in procs:
            assert p.wait(180) == 0, (tmp_path / "log0").read_text()[-3000:]
    finally:
        for p, log in zip(procs, logs, strict=True):
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    bases = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for i in range(2):
        report = json.loads((tmp_path / f"r{i}.json").read_text())
        assert report["pooled"][-1] >= NUMEL * 4, report  # the results did come from the pool
        held = torch.load(tmp_path / f"r{i}.pt", weights_only=True)
        assert len(held) == ROUNDS
        for step, result in enumerate(held):
            expected = (bases[0] + step + bases[1] + step) / 2
            assert torch.allclose(result, expected, atol=1e-5), f"peer {i}: round {step}'s result changed"
        assert len({r.data_ptr() for r in held}) == ROUNDS  # three live results, three buffers
