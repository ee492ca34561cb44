"""PeerMetrics exposition, the /metrics + /sd HTTP server, and a real Prometheus discovering peers through /sd."""

from __future__ import annotations

import json
import math
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from peerd.metrics import (
    FAILURE_REASONS,
    FORMS,
    KINDS,
    OUTCOMES,
    PHASES,
    REJECT_REASONS,
    MetricsError,
    MetricsServer,
    PeerMetrics,
)
from tests.promtools import (
    PrometheusServer,
    dashboard_targets,
    http_get,
    needs_prometheus,
    needs_promtool,
    promtool,
    sd_scrape_config,
)

# Labels Prometheus attaches per target (from /sd and the scrape config); a metric label of the same name would be
# renamed to exported_<name> and break every query, and peer identity as a metric label would be unbounded.
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "peerd.json"
FORBIDDEN_LABELS = {"peer", "peer_id", "run", "instance", "job"}


def make_metrics(**overrides: str) -> PeerMetrics:
    args = {"algorithm": "diloco", "codec": "q4-zstd", "run_id": "5f3a9c1e", "peer_id": "ab12cd34", "version": "0"}
    args.update(overrides)
    return PeerMetrics(**args)


def families(metrics: PeerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def sample_value(metrics: PeerMetrics, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(f"{name}{labels} not exposed")


def exercise(m: PeerMetrics) -> None:
    """Drive every metric at least once, as a daemon would during a few rounds."""
    m.train_loss.set(3.25)
    m.eval_loss.set(3.5)
    m.tokens_per_second.set(12000)
    m.tokens.inc(4096)
    m.inner_step.set(50)
    m.outer_step.set(2)
    m.learning_rate.set(3e-4)
    m.record_sent("reduce", 4_000_000, 520_000)
    m.record_received("gather", 4_000_000, 515_000)
    m.record_round("complete", peers=3, total_seconds=0.4, rendezvous_seconds=0.05, exchange_seconds=0.3)
    m.record_round("partial", peers=2, total_seconds=31.0)
    m.record_failure("timeout")
    m.record_rejected("bad_signature")
    m.known_peers.set(4)
    m.alive_peers.set(3)
    m.record_idle(0.75)


@needs_promtool
@pytest.mark.parametrize("exercised", [False, True], ids=["fresh", "after-events"])
def test_promtool_check_metrics_is_clean(exercised: bool) -> None:
    m = make_metrics()
    if exercised:
        exercise(m)
    out = promtool("check", "metrics", stdin=m.render())
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "" and out.stderr.strip() == "", out.stdout + out.stderr


def test_all_families_exposed_with_types_and_units() -> None:
    fams = families(make_metrics())
    expected = {
        "peerd_train_loss": "gauge",
        "peerd_eval_loss": "gauge",
        "peerd_tokens_per_second": "gauge",
        "peerd_tokens": "counter",
        "peerd_inner_step": "gauge",
        "peerd_outer_step": "gauge",
        "peerd_learning_rate": "gauge",
        "peerd_sent_bytes": "counter",
        "peerd_sent_messages": "counter",
        "peerd_received_bytes": "counter",
        "peerd_compression_ratio": "gauge",
        "peerd_rendezvous_answers": "counter",
        "peerd_round_duration_seconds": "histogram",
        "peerd_round_peers": "gauge",
        "peerd_rounds": "counter",
        "peerd_failures": "counter",
        "peerd_checkpoint_failures": "counter",
        "peerd_rejected_messages": "counter",
        "peerd_known_peers": "gauge",
        "peerd_alive_peers": "gauge",
        "peerd_compute_idle_seconds": "counter",
        "peerd_info": "gauge",
    }
    for name, kind in expected.items():
        assert name in fams, f"{name} missing"
        assert fams[name].type == kind, (name, fams[name].type)
    # The default collectors are on the peer's own registry.
    assert "process_cpu_seconds" in fams or not sys.platform.startswith("linux")
    assert "python_info" in fams
    assert "python_gc_objects_collected" in fams


def test_no_unbounded_or_target_labels() -> None:
    m = make_metrics()
    exercise(m)
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            clash = FORBIDDEN_LABELS & set(s.labels)
            assert not clash, f"{s.name} has label(s) {clash}"


def test_info_carries_bounded_build_labels() -> None:
    m = make_metrics(algorithm="noloco", codec="q8", run_id="feedbeef", version="1.2.3")
    assert sample_value(
        m, "peerd_info", version="1.2.3", algorithm="noloco", codec="q8", run_id="feedbeef"
    ) == pytest.approx(1.0)


def test_known_children_exist_at_zero_before_any_event() -> None:
    m = make_metrics(algorithm="streaming")
    for kind in KINDS:
        for form in FORMS:
            assert sample_value(m, "peerd_sent_bytes_total", kind=kind, form=form) == 0
            assert sample_value(m, "peerd_received_bytes_total", kind=kind, form=form) == 0
        assert sample_value(m, "peerd_sent_messages_total", kind=kind) == 0
    for outcome in OUTCOMES:
        assert sample_value(m, "peerd_rounds_total", algorithm="streaming", outcome=outcome) == 0
    for phase in PHASES:
        assert sample_value(m, "peerd_round_duration_seconds_count", algorithm="streaming", phase=phase) == 0
    for reason in FAILURE_REASONS:
        assert sample_value(m, "peerd_failures_total", reason=reason) == 0
    for reason in REJECT_REASONS:
        assert sample_value(m, "peerd_rejected_messages_total", reason=reason) == 0
    assert sample_value(m, "peerd_compute_idle_seconds_total") == 0
    assert sample_value(m, "peerd_steps_sat_out_total") == 0
    # Unmeasured values read as NaN, never as a (perfect) 0 loss or ratio.
    assert math.isnan(sample_value(m, "peerd_train_loss"))
    assert math.isnan(sample_value(m, "peerd_eval_loss"))
    assert math.isnan(sample_value(m, "peerd_compression_ratio"))


def test_round_histogram_buckets_span_10ms_to_10min() -> None:
    m = make_metrics()
    les = sorted(
        float(s.labels["le"])
        for s in families(m)["peerd_round_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["phase"] == "total"
    )
    assert les[0] == pytest.approx(0.01)
    assert les[-2] == pytest.approx(600.0)
    assert math.isinf(les[-1])


def test_record_helpers_update_the_right_series() -> None:
    m = make_metrics()
    m.record_sent("pair", 1000, 125)
    m.record_sent("pair", 1000, 250)
    assert sample_value(m, "peerd_sent_bytes_total", kind="pair", form="raw") == 2000
    assert sample_value(m, "peerd_sent_bytes_total", kind="pair", form="wire") == 375
    assert sample_value(m, "peerd_sent_messages_total", kind="pair") == 2
    assert sample_value(m, "peerd_compression_ratio") == pytest.approx(4.0)  # the last exchange, not the mean
    m.record_sent("gossip", 0, 300)  # membership traffic has no raw form: it left the ratio at 0 every second
    m.record_sent("rendezvous", 0, 200)
    assert sample_value(m, "peerd_compression_ratio") == pytest.approx(4.0)
    m.record_received("state", 10, 10)
    assert sample_value(m, "peerd_received_bytes_total", kind="state", form="wire") == 10
    m.record_round("partial", peers=2, total_seconds=1.5, exchange_seconds=1.2)
    assert sample_value(m, "peerd_rounds_total", algorithm="diloco", outcome="partial") == 1
    assert sample_value(m, "peerd_round_peers") == 2
    assert sample_value(m, "peerd_round_duration_seconds_count", algorithm="diloco", phase="exchange") == 1
    assert sample_value(m, "peerd_round_duration_seconds_count", algorithm="diloco", phase="rendezvous") == 0
    assert sample_value(m, "peerd_round_duration_seconds_sum", algorithm="diloco", phase="total") == 1.5
    m.record_failure("peer_lost")
    m.record_failure("some new reason")
    assert sample_value(m, "peerd_failures_total", reason="peer_lost") == 1
    assert sample_value(m, "peerd_failures_total", reason="other") == 1
    m.record_rejected("replay")
    m.record_rejected("x" * 1000)  # free text must not become a label value
    assert sample_value(m, "peerd_rejected_messages_total", reason="replay") == 1
    assert sample_value(m, "peerd_rejected_messages_total", reason="other") == 1
    m.record_idle(0.5)
    m.record_idle(0.25)
    assert sample_value(m, "peerd_compute_idle_seconds_total") == pytest.approx(0.75)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.record_sent("telepathy", 1, 1),
        lambda m: m.record_sent("reduce", -1, 1),
        lambda m: m.record_sent("reduce", 1, math.nan),
        lambda m: m.record_received("gather", math.inf, 1),
        lambda m: m.record_round("great", peers=1, total_seconds=1),
        lambda m: m.record_round("complete", peers=-1, total_seconds=1),
        lambda m: m.record_round("complete", peers=1, total_seconds=math.nan),
        lambda m: m.record_idle(-0.1),
    ],
)
def test_record_helpers_reject_bad_input(call) -> None:
    m = make_metrics()
    before = m.render()
    with pytest.raises(MetricsError) as err:
        call(m)
    assert isinstance(err.value, ValueError)
    # A rejected call leaves no partial update behind (only process/gc metrics may move).
    assert _peerd_lines(m.render()) == _peerd_lines(before)


def _peerd_lines(exposition: bytes) -> list[str]:
    return [ln for ln in exposition.decode().splitlines() if ln.startswith("peerd_")]


def test_two_peers_in_one_process_do_not_collide() -> None:
    a, b = make_metrics(peer_id="a"), make_metrics(peer_id="b")
    a.tokens.inc(10)
    assert sample_value(a, "peerd_tokens_total") == 10
    assert sample_value(b, "peerd_tokens_total") == 0


# --- MetricsServer -------------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[tuple[MetricsServer, int, PeerMetrics]]:
    m = make_metrics()
    srv = MetricsServer(m, "127.0.0.1", 0, lambda: [{"targets": ["127.0.0.1:1"], "labels": {"peer": "ab12cd34"}}])
    port = srv.start()
    yield srv, port, m
    srv.stop()


def test_server_serves_metrics(server) -> None:
    _, port, m = server
    m.tokens.inc(77)
    status, ctype, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert ctype == CONTENT_TYPE_LATEST and ctype.startswith("text/plain")
    names = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert names["peerd_tokens_total"] == 77
    # Prometheus appends nothing, but people do: a query string must not turn /metrics into a 404.
    assert http_get(f"http://127.0.0.1:{port}/metrics?x=1")[0] == 200


def test_server_serves_sd_json(server) -> None:
    _, port, _ = server
    status, ctype, body = http_get(f"http://127.0.0.1:{port}/sd")
    assert status == 200
    assert ctype == "application/json"
    assert json.loads(body) == [{"targets": ["127.0.0.1:1"], "labels": {"peer": "ab12cd34"}}]


@pytest.mark.parametrize("path", ["/", "/metricsx", "/sd/extra", "/../etc/passwd", "/favicon.ico"])
def test_server_unknown_paths_are_404(server, path: str) -> None:
    _, port, _ = server
    assert http_get(f"http://127.0.0.1:{port}{path}")[0] == 404


def test_server_survives_broken_sd_callback() -> None:
    calls = {"n": 0}

    def flaky() -> list[dict]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("membership table locked")
        if calls["n"] == 2:
            return [{"targets": [123]}]  # type: ignore[list-item]  # not an HTTP SD document
        return []

    srv = MetricsServer(make_metrics(), "127.0.0.1", 0, flaky)
    port = srv.start()
    try:
        assert http_get(f"http://127.0.0.1:{port}/sd")[0] == 500
        assert http_get(f"http://127.0.0.1:{port}/sd")[0] == 500
        assert http_get(f"http://127.0.0.1:{port}/sd")[:3:2] == (200, b"[]")
        assert http_get(f"http://127.0.0.1:{port}/metrics")[0] == 200
    finally:
        srv.stop()


def test_server_stop_releases_port_and_is_idempotent() -> None:
    srv = MetricsServer(make_metrics(), "127.0.0.1", 0, list)
    srv.stop()  # before start: no-op
    port = srv.start()
    with pytest.raises(RuntimeError):
        srv.start()
    srv.stop()
    srv.stop()
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # The port is free again: a new server can bind exactly it.
    again = MetricsServer(make_metrics(), "127.0.0.1", port, list)
    assert again.start() == port
    again.stop()


def test_server_rejects_bad_port() -> None:
    with pytest.raises(ValueError):
        MetricsServer(make_metrics(), "127.0.0.1", 70000, list)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_server_binds_ipv6() -> None:
    srv = MetricsServer(make_metrics(), "[::1]", 0, list)
    port = srv.start()
    try:
        assert http_get(f"http://[::1]:{port}/metrics")[0] == 200
    finally:
        srv.stop()


# --- A real Prometheus ---------------------------------------------------------------------------------------


@pytest.fixture
def three_peers() -> Iterator[list[tuple[PeerMetrics, int]]]:
    """Three standalone metrics servers whose /sd each list all three, as a swarm's daemons would."""
    ports: list[int] = []
    peers: list[tuple[MetricsServer, PeerMetrics, int]] = []

    def sd() -> list[dict]:
        return [
            {"targets": [f"127.0.0.1:{p}"], "labels": {"peer": f"peer{i}", "run": "5f3a9c1e"}}
            for i, p in enumerate(ports)
        ]

    try:
        for i in range(3):
            m = make_metrics(peer_id=f"peer{i}")
            m.tokens.inc(1000 * (i + 1))
            srv = MetricsServer(m, "127.0.0.1", 0, sd)
            port = srv.start()
            ports.append(port)
            peers.append((srv, m, port))
        yield [(m, port) for _, m, port in peers]
    finally:
        for srv, _, _ in peers:
            srv.stop()


def _scraped_peers(result: list[dict]) -> dict[str, float]:
    return {r["metric"].get("peer", "?"): float(r["value"][1]) for r in result}


@needs_prometheus
def test_real_prometheus_discovers_swarm_through_one_peer(tmp_path, three_peers) -> None:
    ports = [p for _, p in three_peers]
    # Job "peerd" follows one peer's /sd (the deploy/ layout). Job "peerd_multi" follows two peers' /sd, as
    # deploy/README.md advises for resilience: its targets must not double up. One server keeps the test short
    # (Prometheus applies target updates every 5 s).
    config = sd_scrape_config([f"http://127.0.0.1:{ports[0]}/sd"])
    config += sd_scrape_config([f"http://127.0.0.1:{p}/sd" for p in ports[:2]], job="peerd_multi").split(
        "scrape_configs:\n", 1
    )[1]
    check = promtool("check", "config", str(_write(tmp_path / "check.yml", config)))
    assert check.returncode == 0, check.stdout + check.stderr
    with PrometheusServer(tmp_path, config) as prom:
        up = prom.wait_for('up{job="peerd"} == 1', lambda r: len(r) == 3)
        assert _scraped_peers(up) == {"peer0": 1.0, "peer1": 1.0, "peer2": 1.0}
        assert {r["metric"]["run"] for r in up} == {"5f3a9c1e"}
        assert {r["metric"]["instance"] for r in up} == {f"127.0.0.1:{p}" for p in ports}
        # The peers' own series arrive with the target labels attached, values as each peer set them.
        tokens = prom.wait_for('peerd_tokens_total{job="peerd"}', lambda r: len(r) == 3)
        assert _scraped_peers(tokens) == {"peer0": 1000.0, "peer1": 2000.0, "peer2": 3000.0}

        prom.wait_for('up{job="peerd_multi"} == 1', lambda r: len(r) == 3)
        active = prom.api("targets", state="active")["activeTargets"]
        multi = sorted(t["labels"]["peer"] for t in active if t["labels"]["job"] == "peerd_multi")
        assert multi == ["peer0", "peer1", "peer2"]

        # Every query of the Grafana dashboard answers from these peers' series (the label plumbing works);
        # tests/test_prometheus_swarm.py repeats this against real daemons.
        for _, expr in dashboard_targets(json.loads(DASHBOARD.read_text())):
            prom.wait_for(expr, lambda r: len(r) > 0, timeout=15)
        # ...and so do its variables (Grafana's label_values(peerd_info, run) / (..., peer)).
        assert prom.api("label/run/values", **{"match[]": "peerd_info"}) == ["5f3a9c1e"]
        assert prom.api("label/peer/values", **{"match[]": "peerd_info"}) == ["peer0", "peer1", "peer2"]


def _write(path, text: str):
    path.write_text(text)
    return path


def test_metrics_error_is_value_error() -> None:
    assert issubclass(MetricsError, ValueError)
