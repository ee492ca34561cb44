"""Domain-expert ensembles (run.algorithm = "ensemble"): real peers train experts of different sizes on different
domains with no parameter exchange, and `peerd ensemble-eval` mixes their predictive distributions."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peerd.config import RunConfig
from tests.swarm import REPO, Swarm, peer_env, tiny_config
from trainer.mixture import mixture_logprobs, perplexity

_WORDS_TEXT = (
    "the a one every each some many few small large old new early late quiet loud bright dark warm cold river hill "
    "town road garden house window door table letter story song morning evening winter summer friend teacher farmer "
    "child mother father walks reads writes sings waits finds keeps opens closes carries follows remembers crosses "
    "slowly gently often rarely always never again together alone near under over beside through after before and "
    "but because while when then so yet"
)
WORDS = _WORDS_TEXT.split()


def prose_dir(tmp_path: Path) -> Path:
    """A second domain: English-like sentences drawn with a fixed seed, so the corpus is the same in every checkout
    and on every machine (the project's own docs, used before, change with every commit and once left the prose
    expert's short run on an eval-loss spike)."""
    rng = random.Random(7)
    out = tmp_path / "prose"
    out.mkdir()
    for doc in range(4):
        paragraphs = []
        for _ in range(60):
            sentences = []
            for _ in range(rng.randint(3, 6)):
                words = [rng.choice(WORDS) for _ in range(rng.randint(5, 12))]
                sentences.append(" ".join(words).capitalize() + rng.choice((".", ".", ".", "!", "?")))
            paragraphs.append(" ".join(sentences))
        (out / f"prose{doc}.txt").write_text("\n\n".join(paragraphs) + "\n")
    return out


def test_posterior_mixture_follows_the_expert_that_knows_the_text() -> None:
    good = torch.log(torch.full((3, 40), 0.5))
    bad = torch.log(torch.full((3, 40), 0.01))
    lp = torch.stack([bad, good])
    post, uni = perplexity(mixture_logprobs(lp, "posterior")), perplexity(mixture_logprobs(lp, "uniform"))
    assert perplexity(good) <= post < 1.05 * perplexity(good) < uni
    with pytest.raises(ValueError, match="posterior"):
        mixture_logprobs(lp, "median")


def test_ensemble_spec_leaves_each_experts_model_data_and_steps_local(tmp_path: Path) -> None:
    a = RunConfig.from_dict({"run": {"algorithm": "ensemble"}, "model": {"preset": "tiny"}, "inner": {"steps": 5}})
    b = RunConfig.from_dict({"run": {"algorithm": "ensemble"}, "model": {"preset": "small"}, "data": {"domain": "x"}})
    assert a.run_id() == b.run_id()
    c = RunConfig.from_dict({"run": {"algorithm": "ensemble", "seed": 1}})
    assert c.run_id() != a.run_id()  # the run itself (name, seed) is still shared


@pytest.mark.slow
def test_two_experts_train_apart_and_ensemble_eval_mixes_them(tmp_path: Path) -> None:
    prose = prose_dir(tmp_path)
    code_cfg = tiny_config(tmp_path, "code.toml", run__algorithm="ensemble", run__outer_steps=4, data__domain="code")
    prose_cfg = tiny_config(
        tmp_path, "prose.toml", run__algorithm="ensemble", run__outer_steps=3, inner__steps=8,
        model__d_model=48, data__path=str(prose), data__domain="prose",
    )  # fmt: skip
    swarm = Swarm(tmp_path, 2, code_cfg)
    try:
        swarm.peers.append(swarm.spawn(0, None, config=code_cfg, wait_peers=2))
        swarm.peers.append(swarm.spawn(1, swarm.boot_address(0), config=prose_cfg, wait_peers=2))
        for p in swarm.peers:
            p.wait_file("address")
        swarm.wait_until(lambda: all(len(p.status().alive) == 2 for p in swarm.peers), 60, "both experts to meet")
        assert swarm.peers[1].status().algorithm == "ensemble"

        swarm.wait_exit(180)
    finally:
        swarm.stop()
    code, prose_s = (p.summary() for p in swarm.peers)
    assert code["outer_step"] == 4 and prose_s["outer_step"] == 3  # experts may differ in steps
    assert code["domain"] == "code" and prose_s["domain"] == "prose"
    for s in (code, prose_s):
        assert s["finished"] and s["bytes_sent_wire"] == 0 and s["rounds"] == []  # no parameter exchange at all
        assert s["state_downloads"] == 0 and s["forks_healed"] == 0 and s["solo_steps"] == 0
    out = subprocess.run(
        [sys.executable, "-m", "peerd", "ensemble-eval", "--expert", str(tmp_path / "peer0"), "--expert",
         str(tmp_path / "peer1"), "--data", "code=", "--data", f"prose={prose}", "--batches", "4", "--json"],
        capture_output=True, text=True, timeout=120, env=peer_env(), cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["perplexity"]
    for row in rows.values():
        experts = [v for k, v in row.items() if k.startswith("expert:")]
        assert len(experts) == 2 and all(math.isfinite(v) and v > 1 for v in row.values()), row
        # the posterior mixture is never much worse than the best expert on a domain, and beats the worse one
        assert row["ensemble (posterior)"] <= 1.1 * min(experts) and row["ensemble (posterior)"] < max(experts), row
    own = {"code": "expert:peer0 (code)", "prose": "expert:peer1 (prose)"}
    for domain, key in own.items():  # each expert is the better one on its own domain
        other = next(k for k in rows[domain] if k.startswith("expert:") and k != key)
        assert rows[domain][key] < rows[domain][other], rows[domain]


def test_ensemble_eval_bad_inputs_are_one_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "peerd", "ensemble-eval", *args], capture_output=True, text=True, timeout=60,
            env=peer_env(), cwd=REPO,
        )  # fmt: skip

    missing = run("--expert", str(tmp_path / "nope"), "--data", "code=")
    assert missing.returncode == 2 and "no checkpoint" in missing.stderr and "Traceback" not in missing.stderr
    bad = run("--expert", str(tmp_path), "--data", "code")
    assert bad.returncode == 2 and "DOMAIN=PATH" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
