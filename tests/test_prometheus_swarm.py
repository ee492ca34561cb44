"""End to end: three real peers, one real Prometheus pointed at ONE peer's /sd, and every dashboard query answers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.promtools import (
    PrometheusServer,
    dashboard_targets,
    http_get,
    needs_prometheus,
    promtool,
    sd_scrape_config,
)

swarm = pytest.importorskip("tests.swarm", reason="tests/swarm.py (Swarm, tiny_config) is not written yet")

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "peerd.json"
DEADLINE_S = 120.0  # the whole check, after the swarm is up


def wait_for_sd(metrics_address: str, n: int, timeout: float) -> list[dict]:
    """Poll a peer's /sd until it lists n targets (membership converges after start)."""
    deadline = time.monotonic() + timeout
    groups: list[dict] = []
    while time.monotonic() < deadline:
        status, ctype, body = http_get(f"http://{metrics_address}/sd")
        assert status == 200 and ctype.startswith("application/json"), (status, ctype, body[:200])
        groups = json.loads(body)
        if sum(len(g["targets"]) for g in groups) >= n:
            return groups
        time.sleep(0.5)
    raise AssertionError(f"/sd of {metrics_address} lists {groups}, expected {n} targets within {timeout}s")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.slow
@needs_prometheus
def test_every_dashboard_query_returns_data_from_a_real_swarm(tmp_path: Path) -> None:
    config = swarm.tiny_config(tmp_path, run__outer_steps=0)  # train until stopped
    (tmp_path / "swarm").mkdir()
    peers = swarm.Swarm(tmp_path / "swarm", 3, config=config, metrics=True)
    peers.start()
    try:
        addresses = [p.metrics_address for p in peers.peers]
        assert all(addresses), f"peers must serve metrics (--metrics); got {addresses}"
        # Not the bootstrap peer: any peer's /sd must describe the whole swarm.
        groups = wait_for_sd(addresses[1], 3, timeout=60)
        listed = {t for g in groups for t in g["targets"]}
        assert {port_of(t) for t in listed} == {port_of(a) for a in addresses}, (listed, addresses)
        for g in groups:
            assert g["labels"].get("peer"), g  # identity travels as a target label

        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        with PrometheusServer(prom_dir, sd_scrape_config([f"http://{addresses[1]}/sd"])) as prom:
            deadline = time.monotonic() + DEADLINE_S
            up = prom.wait_for('up{job="peerd"} == 1', lambda r: len(r) == 3, timeout=60)
            assert len({r["metric"]["peer"] for r in up}) == 3
            assert len({r["metric"].get("run") for r in up}) == 1  # one run, one label value

            for title, expr in dashboard_targets(json.loads(DASHBOARD.read_text())):
                left = max(5.0, deadline - time.monotonic())
                result = prom.wait_for(expr, lambda r: len(r) > 0, timeout=left)
                assert result, (title, expr)

            # Each daemon's own exposition passes promtool's lint, after real rounds have filled it in.
            for addr in addresses:
                status, _, body = http_get(f"http://{addr}/metrics")
                assert status == 200
                lint = promtool("check", "metrics", stdin=body)
                assert lint.returncode == 0, (addr, lint.stdout, lint.stderr)
                assert b"peerd_rounds_total" in body and b"process_cpu_seconds_total" in body

            # The numbers are live, not just pre-initialised zeros: the peers train and Prometheus sees it.
            left = max(5.0, deadline - time.monotonic())
            prom.wait_for(
                'count(peerd_inner_step{job="peerd"} > 0)', lambda r: r and float(r[0]["value"][1]) == 3, left
            )
            # Every peer counts its rendezvous requests, and the leader its answers on top (bench.scale reads the
            # leader's share from this series).
            left = max(5.0, deadline - time.monotonic())
            rdv = prom.wait_for(
                'peerd_sent_bytes_total{job="peerd", kind="rendezvous", form="wire"} > 0', lambda r: len(r) == 3, left
            )
            sent = sorted(float(r["value"][1]) for r in rdv)
            assert sent[-1] > sent[0], sent
            # The leader answers a member whose previous group it led with the changes to that group's member list,
            # not the whole list (peerd/group_delta.py): with no churn, every answer after a member's first.
            prom.wait_for('sum(peerd_rendezvous_answers_total{job="peerd", form="delta"}) > 0', bool, left)
    finally:
        peers.stop()
