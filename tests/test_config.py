"""Run config: template defaults, validation errors that name the key, and the run id."""

from pathlib import Path

import pytest

from peerd.config import ConfigError, RunConfig, spec_differences
from peerd.config_template import TEMPLATE, write_template


def test_template_parses_to_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    write_template(path)
    assert RunConfig.load(path).spec_json() == RunConfig().spec_json()
    with pytest.raises(ConfigError, match="already exists"):
        write_template(path)
    assert "algorithm" in TEMPLATE


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"bogus": {}}, "unknown config section"),
        ({"inner": {"nope": 1}}, "unknown key inner.nope"),
        ({"inner": {"lr": "fast"}}, "inner.lr"),
        ({"run": {"algorithm": "sgd"}}, "run.algorithm"),
        ({"codec": {"name": "int3"}}, "codec.name"),
        ({"streaming": {"tau": 50}, "inner": {"steps": 10}}, "streaming.tau"),
        ({"streaming": {"tau": "fast"}}, "streaming.tau"),
        ({"streaming": {"tau": 2.5}}, "streaming.tau"),
        ({"streaming": {"tau": True}}, "streaming.tau"),
        ({"run": {"algorithm": "streaming"}, "inner": {"steps": 1}}, "inner.steps"),
        ({"network": {"gossip_entries": 0}}, "network.gossip_entries"),
    ],
)
def test_bad_configs_name_the_key(raw: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        RunConfig.from_dict(raw)


def test_run_id_covers_spec_but_not_local_sections() -> None:
    base = RunConfig()
    assert RunConfig.from_dict({"network": {"peer_timeout": 99.0}}).run_id() == base.run_id()
    assert RunConfig.from_dict({"checkpoint": {"every": 5}}).run_id() == base.run_id()
    assert RunConfig.from_dict({"run": {"outer_steps": 7}}).run_id() == base.run_id()
    changed = RunConfig.from_dict({"inner": {"lr": 0.5}, "codec": {"name": "int4"}})
    assert changed.run_id() != base.run_id()
    assert spec_differences(base.spec(), changed.spec()) == ["codec.name", "inner.lr"]


def test_streaming_tau_is_auto_or_an_int() -> None:
    assert RunConfig().streaming.tau == "auto"
    assert RunConfig.from_dict({"streaming": {"tau": 3}}).streaming.tau == 3
    assert RunConfig.from_dict({"streaming": {"tau": "auto"}}).streaming.tau == "auto"


def test_int_is_accepted_for_float_fields() -> None:
    assert RunConfig.from_dict({"inner": {"lr": 1}}).inner.lr == 1.0
