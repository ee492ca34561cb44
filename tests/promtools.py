"""Test helpers: find promtool/prometheus, and run a real Prometheus server against local targets.

Tests use the real binaries rather than imitating them, because the point is that Prometheus itself accepts
our exposition, our ``/sd`` documents and our configs. CI installs them (Debian/Ubuntu package ``prometheus``).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install prometheus); CI installs it"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus server not installed (apt-get install prometheus); CI installs it"
)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for programs that cannot bind port 0 and report back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str, bytes]:
    """GET a URL; returns (status, content type, body) for any HTTP status, raising only on network errors."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read()


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool; the caller asserts on returncode and shows stdout/stderr on failure."""
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args],
        input=stdin.decode() if stdin is not None else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def sd_scrape_config(sd_urls: list[str], *, job: str = "peerd", interval: str = "1s") -> str:
    """A prometheus.yml that finds its targets through peers' ``/sd`` endpoints (the deploy/ layout)."""
    lines = [
        "global:",
        f"  scrape_interval: {interval}",
        f"  evaluation_interval: {interval}",
        "scrape_configs:",
        f"  - job_name: {job}",
        f"    scrape_interval: {interval}",
        "    http_sd_configs:",
    ]
    lines += [f"      - url: {url}\n        refresh_interval: {interval}" for url in sd_urls]
    return "\n".join(lines) + "\n"


class PrometheusServer:
    """A real Prometheus on a free loopback port, with its config and TSDB under a temporary directory."""

    def __init__(self, workdir: Path, config: str) -> None:
        assert PROMETHEUS is not None
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log()}")
            try:
                if http_get(f"{self.url}/-/ready", timeout=1)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """Call the HTTP API and return its ``data``; raises on an API error (e.g. a PromQL syntax error)."""
        status, _, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        doc = json.loads(body)
        if status != 200 or doc.get("status") != "success":
            raise AssertionError(f"prometheus API {path} {params} -> {status}: {doc}")
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; returns the result vector (list of {metric, value})."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def wait_for(self, expr: str, ok: Any, timeout: float = 30.0) -> list[dict]:
        """Poll an instant query until ``ok(result)`` holds; fails with the last result and the server log."""
        deadline = time.monotonic() + timeout
        result: list[dict] = []
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                targets = self.api("targets")
                raise AssertionError(
                    f"{expr!r}: condition not met in {timeout}s; last result {result}\n"
                    f"targets: {json.dumps(targets)[:3000]}\nprometheus log:\n{self.log()[-3000:]}"
                )
            time.sleep(0.5)


# --- The Grafana dashboard's queries -------------------------------------------------------------------------

# Values for Grafana's variables that make a dashboard query plain PromQL: all runs and peers, a 1m window
# (at least four scrapes at the 15 s deploy interval, and many at the tests' 1 s).
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "5m", "$run": ".*", "$peer": ".*"}


def to_promql(expr: str) -> str:
    """Replace Grafana variables by concrete values; fails on a variable this helper does not know."""
    for var in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(var, GRAFANA_VARS[var])
    if "$" in expr:
        raise AssertionError(f"unknown Grafana variable in {expr!r}")
    return expr


def dashboard_targets(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every target of every panel, rows' nested panels included."""
    out = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", "?"), to_promql(target["expr"])))
    return out


def iter_panels(dashboard: dict) -> list[dict]:
    """All panels, flattening collapsed rows (whose children sit in the row's own ``panels``)."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out
