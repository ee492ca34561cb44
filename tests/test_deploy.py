"""deploy/: Prometheus config, Grafana provisioning and dashboard, Dockerfile, docker-compose and systemd unit."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from peerd.metrics import PeerMetrics
from tests.promtools import PROMETHEUS, dashboard_targets, iter_panels, needs_promtool, promtool

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "peerd.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "peerd.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
UNIT = DEPLOY / "peerd.service"

SUBCOMMANDS = {"init", "start", "status", "demo"}
START_FLAGS = {"--config", "--listen", "--bootstrap", "--data-dir", "--metrics", "--announce", "--insecure"}
# Labels Prometheus adds per target: from the scrape config (job, instance) and from each peer's /sd (peer, run).
TARGET_LABELS = {"job", "instance", "peer", "run"}
# Series Prometheus synthesises for every target; they are not in any exposition.
SYNTHETIC = {"up": set()}
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
    "inf", "nan",
}  # fmt: skip


@cache
def exposed() -> dict[str, set[str]]:
    """Sample name -> label names, as a real PeerMetrics renders them (plus Prometheus' synthetic series)."""
    m = PeerMetrics(algorithm="diloco", codec="q4", run_id="r", peer_id="p", version="0")
    out: dict[str, set[str]] = {name: set(labels) for name, labels in SYNTHETIC.items()}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


@cache
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@cache
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def datasource_uid() -> str:
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    return ds["uid"]


def metric_selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names matched) for every series selector in a PromQL expression."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals cannot hide names
    found: list[tuple[str, set[str]]] = []
    for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        found.append((name, set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))))
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    for token in re.finditer(r"(?<![\w.:])([a-zA-Z_:][\w:]*)\b(?!\s*\()", bare):
        name = token.group(1)
        if name.lower() not in PROMQL_WORDS and not any(name == n for n, _ in found):
            found.append((name, set()))
    return found


def test_metric_selector_extraction_sees_every_name() -> None:
    got = metric_selectors(
        'histogram_quantile(0.9, sum by (le, phase) (rate(a_bucket{x="1", y=~"b|c"}[1m]))) / on (z) b_total'
    )
    assert got == [("a_bucket", {"x", "y"}), ("b_total", set())]


# --- Prometheus ----------------------------------------------------------------------------------------------


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    out = promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_swarm_through_a_peers_sd() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert "static_configs" not in job  # the swarm is discovered, never listed by hand
    urls = [sd["url"] for sd in job["http_sd_configs"]]
    assert urls and all(u.endswith("/sd") for u in urls)
    # The URL names a compose peer by its service name and its --metrics port.
    host, port = re.match(r"http://([^/:]+):(\d+)/sd$", urls[0]).groups()  # type: ignore[union-attr]
    command = compose()["services"][host]["command"]
    assert command[command.index("--metrics") + 1].endswith(f":{port}")
    assert "different peer" in (DEPLOY / "prometheus.yml").read_text()  # the hint for re-pointing it


# --- Grafana -------------------------------------------------------------------------------------------------


def test_grafana_datasource_and_dashboard_provider() -> None:
    (ds,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert ds["type"] == "prometheus" and ds["uid"] and ds["url"].startswith("http")
    assert ds["url"].split("//")[1].split(":")[0] in compose()["services"]
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    # Compose mounts the dashboards directory exactly where the provider reads from.
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 36 and d["uid"] and d["title"]
    panels = iter_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    uid = datasource_uid()
    for p in panels:
        assert p["type"] in {"row", "timeseries", "stat"}, p["type"]
        gp = p["gridPos"]
        assert all(isinstance(gp[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert gp["x"] + gp["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        targets = p.get("targets", [])
        assert targets and all(t.get("expr", "").strip() for t in targets), f"{p['title']} has no query"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
    for var in d["templating"]["list"]:
        assert var["datasource"] == {"type": "prometheus", "uid": uid}, var["name"]


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in iter_panels(dashboard()):
        gp = p["gridPos"]
        for x in range(gp["x"], gp["x"] + gp["w"]):
            for y in range(gp["y"], gp["y"] + gp["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_dashboard_has_required_rows_and_panels() -> None:
    panels = iter_panels(dashboard())
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Swarm overview", "Communication", "Health"]
    exprs = " ".join(e for _, e in dashboard_targets(dashboard()))
    for needle in [
        "peerd_alive_peers",
        "peerd_train_loss",
        "rate(peerd_tokens_total",
        "peerd_outer_step",
        'peerd_sent_bytes_total{run=~".*", peer=~".*", form="wire"}',
        "peerd_compression_ratio",
        "histogram_quantile(0.5, ",
        "histogram_quantile(0.95, ",
        "peerd_failures_total",
        'outcome="partial"',
        "peerd_rejected_messages_total",
        "rate(peerd_compute_idle_seconds_total",
    ]:
        assert needle in exprs, needle


def test_dashboard_queries_use_only_exposed_metrics_and_labels() -> None:
    metrics = exposed()
    queries = list(dashboard_targets(dashboard()))
    queries += [(f"variable {v['name']}", v["definition"]) for v in dashboard()["templating"]["list"]]
    for title, expr in queries:
        expr = re.sub(r"label_values\((.*),\s*\w+\)", r"\1", expr).replace("$run", ".*")
        selectors = metric_selectors(expr)
        assert selectors, (title, expr)
        for name, labels in selectors:
            assert name in metrics, f"{title}: {name} is not exposed by PeerMetrics"
            unknown = labels - metrics[name] - TARGET_LABELS
            assert not unknown, f"{title}: {name} has no label(s) {unknown}"
        for grouping in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in (s.strip() for s in grouping.split(",")):
                assert any(label in metrics[n] | TARGET_LABELS for n, _ in selectors), (title, label)


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": expr}
                    for i, (_, expr) in enumerate(dashboard_targets(dashboard()))
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


# --- Docker --------------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    ins = dockerfile_instructions()
    (base,) = [rest for word, rest in ins if word == "FROM"]
    assert "cuda" in base.lower()
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert re.search(r"pip install \.(\s|$)", runs)
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] not in {"root", "0", "0:0"}
    assert ins.index(("USER", users[-1])) < [w for w, _ in ins].index("ENTRYPOINT")
    (entrypoint,) = [json.loads(rest) for word, rest in ins if word == "ENTRYPOINT"]
    assert entrypoint == ["peerd"]
    exposed_ports = {p for word, rest in ins if word == "EXPOSE" for p in rest.split()}
    assert {"7000", "9100"} <= exposed_ports
    volumes = [json.loads(rest) for word, rest in ins if word == "VOLUME"]
    assert ["/data"] in volumes
    # Everything the Dockerfile copies exists in the repository (the build context is the repo root).
    for word, rest in ins:
        if word == "COPY":
            for src in rest.split()[:-1]:
                assert (DEPLOY.parent / src).exists() or src == "README.md", src


def peer_services() -> dict[str, dict]:
    return {n: s for n, s in compose()["services"].items() if s.get("image", "").startswith("peerd")}


def peerd_invocations(service: dict) -> list[list[str]]:
    """The peerd command lines a service runs: its command under the peerd entrypoint, or inside a shell."""
    command = service.get("command", [])
    command = shlex.split(command) if isinstance(command, str) else command
    if "entrypoint" not in service:
        return [command]
    out = []
    for script in command:
        for m in re.finditer(r"(?<![\w/.-])peerd((?:\s+[^\s;&|]+)+)", script):
            out.append(m.group(1).split())
    return out


def test_compose_peers_use_only_known_subcommands_and_flags() -> None:
    peers = peer_services()
    starts = {}
    for name, service in peers.items():
        invocations = peerd_invocations(service)
        assert invocations, name
        for argv in invocations:
            assert argv and argv[0] in SUBCOMMANDS, (name, argv)
            if argv[0] == "start":
                flags = {a for a in argv if a.startswith("--")}
                assert flags <= START_FLAGS, (name, flags - START_FLAGS)
                starts[name] = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert sorted(starts) == ["peer1", "peer2", "peer3"]
    for name, args in starts.items():
        assert args["--config"] == "/config/run.toml"
        assert args["--listen"] == "0.0.0.0:7000"
        assert args["--metrics"] == "0.0.0.0:9100"
        assert args["--data-dir"] == "/data"
        assert args["--announce"] == f"{name}:7000"  # a name the other containers resolve
        assert f"{name}-data:/data" in peers[name]["volumes"]
    assert "--bootstrap" not in starts["peer1"]
    assert starts["peer2"]["--bootstrap"] == starts["peer3"]["--bootstrap"] == "peer1:7000"


def test_compose_prometheus_and_grafana() -> None:
    services = compose()["services"]
    prom = services["prometheus"]
    assert prom["image"].startswith("prom/prometheus:")
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    if PROMETHEUS is not None:  # every flag is one the real server knows
        help_text = subprocess.run([PROMETHEUS, "--help"], capture_output=True, text=True, timeout=30)
        known = set(re.findall(r"--[\w.-]+", help_text.stdout + help_text.stderr))
        for flag in prom["command"]:
            assert flag.split("=")[0] in known, flag
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    assert "GF_AUTH_ANONYMOUS_ENABLED" in services["grafana"]["environment"]
    for name, service in services.items():
        if "build" in service:
            assert service["build"]["dockerfile"] == "deploy/Dockerfile", name
            assert (COMPOSE.parent / service["build"]["context"] / "deploy" / "Dockerfile").exists()


@pytest.mark.skipif(importlib.util.find_spec("peerd.cli") is None, reason="peerd.cli not written yet")
def test_compose_flags_exist_in_the_real_cli() -> None:
    for argv in [a for s in peer_services().values() for a in peerd_invocations(s)]:
        out = subprocess.run(
            [sys.executable, "-c", "import sys; from peerd.cli import main; sys.exit(main())", argv[0], "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        for flag in (a for a in argv if a.startswith("--")):
            assert flag in out.stdout, f"peerd {argv[0]} has no {flag}"


# --- systemd -------------------------------------------------------------------------------------------------


def unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as section -> [(key, value)], keeping repeated keys (Environment= may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        else:
            assert current is not None, f"key outside a section: {line}"
            key, sep, value = line.partition("=")
            assert sep, f"not key=value: {line}"
            current.append((key.strip(), value.strip()))
    return sections


def test_systemd_unit_content() -> None:
    sections = unit_sections(UNIT.read_text())
    assert set(sections) == {"Unit", "Service", "Install"}
    service = dict(sections["Service"])
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "peerd" and argv[0].startswith("/")
    assert argv[1] == "start"
    flags = {a for a in argv if a.startswith("--")}
    assert {"--config", "--bootstrap", "--data-dir"} <= flags <= START_FLAGS
    assert argv[argv.index("--data-dir") + 1] == "/var/lib/peerd"
    assert argv[argv.index("--config") + 1] == "/etc/peerd/run.toml"
    assert service["Restart"] == "on-failure"
    assert service["User"] not in {"root", "0"}
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service["StateDirectory"] == "peerd"
    assert "PrivateDevices" not in service  # it would hide the GPU
    # Every ${VAR} in ExecStart has a default, so the unit starts even without /etc/peerd/peerd.env.
    defaults = {v.split("=", 1)[0] for k, v in sections["Service"] if k == "Environment"}
    assert set(re.findall(r"\$\{(\w+)\}", service["ExecStart"])) <= defaults
    assert dict(sections["Install"])["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path) -> None:
    # verify insists that ExecStart's binary exists; point it at a stand-in so only the unit itself is judged.
    stub = tmp_path / "peerd"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    unit = tmp_path / "peerd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/peerd", str(stub)))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Unknown" not in out.stderr and "ignoring" not in out.stderr, out.stderr
