"""Run configuration: load and validate run.toml, and hash the shared part of it into the run id.

The config has two kinds of section. *Spec* sections (run, model, data, inner, outer, noloco, streaming, codec,
admission, robust) must be identical on every peer of a run, so they hash into the run id and a Join with a different
spec is refused with the names of the fields that differ. *Local* sections (network, checkpoint, security) are
per-machine tuning and secrets, and never leave the peer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The wire protocol's revision (proto/peerd/v1/peerd.proto, header): part of the run spec, so peers that speak
# different revisions never meet in one run; the Join refusal names the field "protocol".
PROTOCOL = 16
ALGORITHMS = ("diloco", "streaming", "noloco", "ddp", "ensemble")  # ddp: every-step gradient all-reduce baseline
CODECS = ("fp32", "bf16", "int8", "fp8", "e3m0", "int4", "sparse")
FEEDBACK_AGAINST = ("contribution", "average")  # peerd.codecs.feedback.FEEDBACK_AGAINST
SPARSE_BITS = (2, 4, 8)  # peerd.codecs.sparse.BITS_CHOICES (this module stays free of torch)
SPARSE_MAX_BLOCK = 1 << 16  # peerd.codecs.sparse.MAX_SPARSE_BLOCK: block positions fit 16-bit indices

# What `--codec sparse` (peerd demo, bench.convergence, bench.uneven) adds: error feedback as a decaying accumulator
# measured against the applied average, which stands in for outer momentum (SparseLoCo), so the outer step is plain
# SGD. The outer lr is the best measured on the tiny model (BENCHMARKS.md, sparse eval loss): tune it on yours.
# Streaming DiLoCo diverged at lr 3 with its default merge (alpha 0.5 leaves half of each fragment's gap to the new
# global in the next pseudo-gradient, which a large outer lr amplifies), so its recipe merges fully (alpha 0) and
# measured best at lr 8.
SPARSE_RECIPE: dict[str, dict[str, Any]] = {
    "codec": {"error_feedback": True, "feedback_decay": 0.8, "feedback_against": "average"},
    "outer": {"momentum": 0.0, "lr": 5.0},
}
SPARSE_STREAMING_RECIPE: dict[str, dict[str, Any]] = {
    "codec": dict(SPARSE_RECIPE["codec"]),
    "outer": {"momentum": 0.0, "lr": 8.0},
    "streaming": {"alpha": 0.0},
}


def sparse_recipe(algorithm: str) -> dict[str, dict[str, Any]]:
    """The config keys `--codec sparse` adds for `algorithm` (a fresh copy: callers update it)."""
    recipe = SPARSE_STREAMING_RECIPE if algorithm == "streaming" else SPARSE_RECIPE
    return {section: dict(keys) for section, keys in recipe.items()}


def apply_codec_recipe(raw: dict[str, Any], algorithm: str) -> None:
    """What `--codec sparse` means in peerd demo and the benches: add its recipe's keys to the raw config sections
    when `raw` names the sparse codec (before `--set` overrides, which the callers apply after). Other codecs: none."""
    if raw.get("codec", {}).get("name") != "sparse":
        return
    for section, keys in sparse_recipe(algorithm).items():
        raw.setdefault(section, {}).update(keys)


class ConfigError(ValueError):
    """A run.toml that cannot be used, with a message that names the offending key."""


@dataclass
class RunSection:
    name: str = "peerd-run"
    algorithm: str = "diloco"
    seed: int = 0
    outer_steps: int = 0  # stop after this many outer steps; 0 runs until stopped
    # sha256 (hex) of the file every peer starts from (`peerd start --init-from FILE` fills it in when empty); "" with
    # no --init-from: initial weights come from the seed
    init_digest: str = ""


@dataclass
class ModelSection:
    preset: str = "tiny"
    factory: str = ""  # "package.module:factory" to train your own model instead of the built-in one
    config: str = ""  # a model config file handed to the factory (trainer.hf:causal_lm: a transformers config.json)
    n_layer: int = 0  # 0 keeps the preset's value
    n_head: int = 0
    d_model: int = 0
    seq_len: int = 0


@dataclass
class DataSection:
    path: str = ""  # directory of text files or a uint16 token file; empty = the Python standard library sources
    factory: str = ""  # "package.module:factory" returning (train, eval) data objects instead of the built-in reader
    domain: str = ""  # ensembles: the name of this expert's data domain (reported by `peerd ensemble-eval`)
    tokenizer: str = ""  # a tokenizers tokenizer.json: text becomes its uint16 ids, not bytes (trainer/tokenize.py)
    batch_size: int = 8
    num_shards: int = 16  # the train stream is cut in this many striped shards; each peer reads its own
    eval_batches: int = 4


@dataclass
class InnerSection:
    steps: int = 20  # H: inner steps per outer step
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    total_steps: int = 0  # >0: cosine decay of the inner lr to 10% at this inner step; 0: constant after warmup
    # DiLoCo/Streaming: >0 trains this many wall-clock seconds per outer step (as many inner steps as fit, >= one)
    # instead of exactly `steps`, so fast peers never wait for slow ones; rounds weight contributions by their tokens
    window_s: float = 0.0
    # re-warmup when the weights jump: a run started with --init-from warms up over this many steps (instead of
    # warmup_steps), and a peer that adopts a downloaded state 2+ outer steps ahead of its own (or a diverged one)
    # resets its AdamW moments and warms up again over it; "auto": warmup_steps; 0: never
    rewarm_steps: int | str = "auto"


@dataclass
class OuterSection:
    lr: float = 0.7
    momentum: float = 0.9
    # a peer whose round went on without it (late, or behind): "carry" adds its pseudo-gradient to its next round,
    # on top of the swarm's new state; "discard" drops it and restarts from the swarm's state
    late_work: str = "carry"
    # DiLoCo: a peer the swarm flags slow for its link: "sponsor" stops joining rounds and sends its work through a
    # sponsor (peerd/sponsor.py), so no round waits for its link; "wait": it stays in every round
    slow_link: str = "sponsor"
    # sponsored contributions before a sponsored peer rejoins rounds for five rounds, to see whether its link
    # recovered (doubling after each probe that finds it still slow; 0: never)
    sponsor_probe: int = 16
    # DiLoCo: run each round while the next window trains from an eager guess of the next global state, applied when
    # it lands (peerd/diloco.py), so the round costs no compute time unless it takes longer than a window; the run's
    # last round stays synchronous
    overlap: bool = False


@dataclass
class NolocoSection:
    alpha: float = 0.5
    beta: float = 0.7
    gamma: float = 0.7
    group_size: int = 2
    max_staleness: int = 1  # pair only with peers whose outer step is within this many steps
    send_ahead: bool = False  # send the slow weights at the end of the previous outer step, overlapping compute


@dataclass
class StreamingSection:
    fragments: int = 2
    mode: str = "strided"  # or "sequential"
    # inner steps between a fragment's sync start and its local merge; "auto": from the measured round and inner step
    # times, so a sync stays hidden behind compute on any link (local only: merges never touch the global copy)
    tau: int | str = "auto"
    alpha: float = 0.5  # local <- alpha*local + (1-alpha)*new_global
    late_policy: str = "wait"  # or "skip": what the trainer does when an exchange is not done by t + tau


@dataclass
class CodecSection:
    name: str = "fp32"
    # codecs.compression.DEFAULT_LEVEL (importing it here would load torch; tests/test_codecs.py keeps them equal)
    zstd_level: int = 1
    block_size: int = 256
    error_feedback: bool = False
    # With error feedback: how much of the last residual the next round adds back (< 1: a decaying accumulator that
    # stands in for outer momentum), and what the residual is measured against (peerd/codecs/feedback.py).
    feedback_decay: float = 1.0
    feedback_against: str = "contribution"  # or "average": the average the swarm applied
    density: float = 0.04  # "sparse" only: share of each block's values sent (top-k, k = ceil(density * block_size))
    bits: int = 2  # "sparse" only: bits per kept value (sign + magnitude level)


@dataclass
class AdmissionSection:
    mode: str = "open"  # open | secret | allowlist | invite (peerd/admission.py)
    allowlist: list[str] = field(default_factory=list)  # hex Ed25519 public keys admitted in mode "allowlist"
    owner_key: str = ""  # hex public key of the run owner who signs invitations in mode "invite"


@dataclass
class RobustSection:
    aggregation: str = "mean"  # mean | trimmed_mean | clipped_mean, computed by each shard's owner
    max_norm_ratio: float = 10.0  # refuse a contribution whose norm exceeds this times the owner's own; 0: off
    trim_fraction: float = 0.2  # trimmed_mean: share of contributions dropped at each end per coordinate
    clip_ratio: float = 2.0  # clipped_mean: clip each contribution to this times the median contribution norm


@dataclass
class SecuritySection:
    """Local: secrets never enter the spec (or its hash), and limits may differ per machine."""

    join_secret_file: str = ""  # admission mode "secret": file (mode 0600) holding the shared join secret
    invite_file: str = ""  # admission mode "invite": this peer's invitation from the run owner (peerd invite)
    ban_after: int = 3  # invalid contributions from one peer (within ban_window) before it is banned
    ban_window: float = 600.0
    ban_seconds: float = 600.0
    rate_limit: float = 200.0  # requests per second per peer (token bucket), keyed by key or else by address
    rate_burst: float = 400.0
    max_streams_per_peer: int = 16  # concurrent streaming RPCs per peer
    max_inflight_mb_per_peer: float = 256.0  # payload bytes one peer may have us buffer at once
    read_timeout: float = 30.0  # seconds a stream may go without sending its next message


@dataclass
class NetworkSection:
    gossip_interval: float = 1.0
    gossip_entries: int = 8  # peer entries per gossip message (plus our own): per-peer gossip stays flat as n grows
    peer_timeout: float = 10.0  # a peer whose heartbeat has not advanced for this long is dropped
    rendezvous_timeout: float = 30.0  # how long a round's leader waits for expected peers
    round_timeout: float = 120.0  # how long an exchange may take before the round fails
    match_timeout: float = 10.0  # NoLoCo: how long a peer looks for a partner before stepping alone
    chunk_bytes: int = 1 << 20
    redial_max: float = 5.0  # dead peers and bootstrap addresses are re-dialled with backoff up to this, forever
    forget_after: float = 300.0  # a dead peer stays expected in rounds (they are partial without it) for this long
    linger: float = 30.0  # after the last outer step, serve state this long for peers still finishing or restarting
    join_timeout: float = 60.0  # how long `peerd start` retries a bootstrap address where nothing answers
    relay: bool = True  # when reachable, carry NoLoCo calls for outbound-only peers (peerd/relay.py)
    relay_max_peers: int = 16  # outbound-only peers that may attach at once
    relay_peer_mbit: float = 100.0  # relayed traffic per attached peer, both directions (burst: 64 MiB)
    start_barrier: bool = True  # --wait-peers N: also take the first inner step together (peerd/startbarrier.py)


@dataclass
class CheckpointSection:
    every: int = 1  # outer steps between checkpoints


SPEC_SECTIONS = ("run", "model", "data", "inner", "outer", "noloco", "streaming", "codec", "admission", "robust")
LOCAL_SECTIONS = ("network", "checkpoint", "security")


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    inner: InnerSection = field(default_factory=InnerSection)
    outer: OuterSection = field(default_factory=OuterSection)
    noloco: NolocoSection = field(default_factory=NolocoSection)
    streaming: StreamingSection = field(default_factory=StreamingSection)
    codec: CodecSection = field(default_factory=CodecSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    robust: RobustSection = field(default_factory=RobustSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    # sha256 of the files the spec names, filled in by validate(); in the spec as "files" when any is set
    file_digests: dict[str, str] = field(default_factory=dict, repr=False)

    # -- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Build a config from nested dicts, refusing unknown sections/keys and wrongly typed values."""
        cfg = cls()
        for section, values in raw.items():
            if section not in SPEC_SECTIONS + LOCAL_SECTIONS:
                raise ConfigError(f"unknown config section [{section}]")
            if not isinstance(values, dict):
                raise ConfigError(f"[{section}] must be a table")
            target = getattr(cfg, section)
            known = {f.name: f for f in dataclasses.fields(target)}
            for key, value in values.items():
                if key not in known:
                    raise ConfigError(f"unknown key {section}.{key}")
                default = getattr(target, key)
                setattr(target, key, _coerce(f"{section}.{key}", value, default))
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
        return cls.from_dict(raw)

    def validate(self) -> None:
        if self.run.algorithm not in ALGORITHMS:
            raise ConfigError(f"run.algorithm must be one of {ALGORITHMS}, not {self.run.algorithm!r}")
        self._validate_codec()
        if self.inner.steps < 1:
            raise ConfigError("inner.steps must be >= 1")
        rewarm = self.inner.rewarm_steps
        if rewarm != "auto" and not (isinstance(rewarm, int) and rewarm >= 0):
            raise ConfigError(f'inner.rewarm_steps must be "auto" or an int >= 0, got {rewarm!r}')
        if self.run.init_digest and not _is_hex_key(self.run.init_digest):
            raise ConfigError("run.init_digest must be a 64-hex-digit sha256 (peerd start --init-from fills it in)")
        self._digest_files()
        if self.data.batch_size < 1 or self.data.num_shards < 1:
            raise ConfigError("data.batch_size and data.num_shards must be >= 1")
        if self.noloco.group_size < 2:
            raise ConfigError("noloco.group_size must be >= 2")
        if self.streaming.mode not in ("strided", "sequential"):
            raise ConfigError("streaming.mode must be 'strided' or 'sequential'")
        if self.streaming.late_policy not in ("wait", "skip"):
            raise ConfigError("streaming.late_policy must be 'wait' or 'skip'")
        if not 0.0 <= self.streaming.alpha <= 1.0:
            raise ConfigError("streaming.alpha must be in [0, 1]")
        if self.streaming.fragments < 1:
            raise ConfigError("streaming.fragments must be >= 1")
        tau = self.streaming.tau
        if self.run.algorithm == "streaming" and self.inner.steps < 2:
            raise ConfigError("streaming needs inner.steps >= 2 (a fragment's exchange overlaps at least one step)")
        if tau != "auto" and not (isinstance(tau, int) and 1 <= tau < self.inner.steps):
            raise ConfigError(
                f'streaming.tau must be "auto" or an int in [1, inner.steps={self.inner.steps}), got {tau!r}'
            )
        if not (0.0 <= self.inner.window_s < math.inf):
            raise ConfigError(
                f"inner.window_s must be >= 0 seconds (0: exactly inner.steps), got {self.inner.window_s}"
            )
        if self.inner.window_s > 0 and self.run.algorithm not in ("diloco", "streaming"):
            raise ConfigError(
                f"inner.window_s works with run.algorithm = 'diloco' or 'streaming', not {self.run.algorithm!r}: "
                f"set inner.window_s = 0"
            )
        if self.outer.late_work not in ("carry", "discard"):
            raise ConfigError(f"outer.late_work must be 'carry' or 'discard', not {self.outer.late_work!r}")
        if self.outer.sponsor_probe < 0:
            raise ConfigError(f"outer.sponsor_probe must be >= 0 (0: never probe), not {self.outer.sponsor_probe}")
        if self.outer.slow_link not in ("sponsor", "wait"):
            raise ConfigError(f"outer.slow_link must be 'sponsor' or 'wait', not {self.outer.slow_link!r}")
        if self.admission.mode not in ("open", "secret", "allowlist", "invite"):
            raise ConfigError("admission.mode must be open, secret, allowlist or invite")
        self._validate_security()
        if not 0 < self.network.chunk_bytes <= 1 << 20:
            raise ConfigError("network.chunk_bytes must be in (0, 1 MiB]")
        if self.network.gossip_entries < 1:
            raise ConfigError("network.gossip_entries must be >= 1 (peer entries per gossip message; 8 is the default)")
        if not 0 < self.network.join_timeout < math.inf:
            raise ConfigError("network.join_timeout must be > 0 seconds")
        if self.network.relay_max_peers < 0 or not self.network.relay_peer_mbit > 0:
            raise ConfigError("network.relay_max_peers must be >= 0 and network.relay_peer_mbit > 0")

    @property
    def rewarm_steps(self) -> int:
        """inner.rewarm_steps with "auto" resolved to inner.warmup_steps."""
        r = self.inner.rewarm_steps
        return self.inner.warmup_steps if r == "auto" else int(r)

    def _digest_files(self) -> None:
        """Hash the files the spec names (model config, tokenizer) once: their contents, not only their paths, are part
        of the run id, so peers holding different files at the same path never mix."""
        self.file_digests = {}
        for key, value in (("model.config", self.model.config), ("data.tokenizer", self.data.tokenizer)):
            if not value:
                continue
            try:
                self.file_digests[key] = hashlib.sha256(Path(value).read_bytes()).hexdigest()
            except OSError as exc:
                raise ConfigError(f"{key} = {value!r}: cannot read it ({exc.strerror or exc})") from None

    def _validate_codec(self) -> None:
        """The sparse codec's keys, and what it needs: error feedback, which DiLoCo and Streaming DiLoCo carry (NoLoCo
        sends weights, which must not be sparsified, and ddp sends every step's gradient)."""
        codec, default = self.codec, CodecSection()
        if codec.name not in CODECS:
            raise ConfigError(f"codec.name must be one of {CODECS}, not {codec.name!r}")
        if not (0.0 < codec.density <= 1.0):
            raise ConfigError(f"codec.density must be in (0, 1], got {codec.density!r}")
        if not (0.0 < codec.feedback_decay <= 1.0):
            raise ConfigError(f"codec.feedback_decay must be in (0, 1], got {codec.feedback_decay!r}")
        if codec.feedback_against not in FEEDBACK_AGAINST:
            against = codec.feedback_against
            raise ConfigError(f"codec.feedback_against must be one of {FEEDBACK_AGAINST}, not {against!r}")
        tuned = codec.feedback_decay != default.feedback_decay or codec.feedback_against != default.feedback_against
        if tuned and not codec.error_feedback:
            raise ConfigError("codec.feedback_decay and codec.feedback_against need codec.error_feedback = true")
        if codec.bits not in SPARSE_BITS:
            raise ConfigError(f"codec.bits must be one of {SPARSE_BITS}, got {codec.bits!r}")
        if codec.name != "sparse":
            if codec.density != default.density:
                raise ConfigError(f"codec.density only applies to codec.name = 'sparse' (this run uses {codec.name!r})")
            if codec.bits != default.bits:
                raise ConfigError(f"codec.bits only applies to codec.name = 'sparse' (this run uses {codec.name!r})")
            return
        if not 2 <= codec.block_size <= SPARSE_MAX_BLOCK:
            raise ConfigError(f"codec.block_size must be in [2, {SPARSE_MAX_BLOCK}] with codec.name = 'sparse'")
        if not codec.error_feedback:
            raise ConfigError("codec.name = 'sparse' needs codec.error_feedback = true: it drops most of each update")
        if self.run.algorithm not in ("diloco", "streaming"):
            raise ConfigError(
                f"codec.name = 'sparse' needs run.algorithm = 'diloco' or 'streaming' (they carry error feedback), "
                f"not {self.run.algorithm!r}"
            )

    def _validate_security(self) -> None:
        adm, rob, sec = self.admission, self.robust, self.security
        for i, key in enumerate(adm.allowlist):
            if not _is_hex_key(key):
                raise ConfigError(f"admission.allowlist[{i}] must be a 64-hex-digit public key, got {key!r}")
        if adm.owner_key and not _is_hex_key(adm.owner_key):
            raise ConfigError("admission.owner_key must be a 64-hex-digit public key")
        if adm.mode == "allowlist" and not adm.allowlist:
            raise ConfigError("admission.allowlist must list at least one key when admission.mode = 'allowlist'")
        if adm.mode == "invite" and not adm.owner_key:
            raise ConfigError("admission.owner_key is required when admission.mode = 'invite'")
        if rob.aggregation not in ("mean", "trimmed_mean", "clipped_mean"):
            raise ConfigError("robust.aggregation must be mean, trimmed_mean or clipped_mean")
        if not (rob.max_norm_ratio == 0 or rob.max_norm_ratio >= 1.0) or not math.isfinite(rob.max_norm_ratio):
            raise ConfigError("robust.max_norm_ratio must be 0 (off) or >= 1")
        if not 0.0 <= rob.trim_fraction < 0.5:
            raise ConfigError("robust.trim_fraction must be in [0, 0.5)")
        if not 0.0 < rob.clip_ratio < math.inf:
            raise ConfigError("robust.clip_ratio must be > 0")
        if sec.ban_after < 1 or sec.ban_window <= 0 or sec.ban_seconds < 0:
            raise ConfigError("security.ban_after must be >= 1, ban_window > 0 and ban_seconds >= 0")
        if sec.rate_limit <= 0 or sec.rate_burst < 1 or sec.max_streams_per_peer < 1:
            raise ConfigError("security.rate_limit, rate_burst and max_streams_per_peer must be positive")
        if sec.max_inflight_mb_per_peer <= 0 or sec.read_timeout <= 0:
            raise ConfigError("security.max_inflight_mb_per_peer and security.read_timeout must be positive")

    # -- run identity ----------------------------------------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        """The part of the config every peer of the run must share. `run.outer_steps` is left out: it only says when
        this peer stops, so a peer may leave early or a restart may train longer without forking the run."""
        spec = {name: dataclasses.asdict(getattr(self, name)) for name in SPEC_SECTIONS}
        del spec["run"]["outer_steps"]
        if self.codec.name != "sparse":  # always the defaults then: left out of the spec
            del spec["codec"]["density"], spec["codec"]["bits"]
        for section, key, default in (
            ("run", "init_digest", ""),
            ("model", "config", ""),
            ("data", "tokenizer", ""),
            ("inner", "rewarm_steps", "auto"),
            ("codec", "feedback_decay", 1.0),
            ("codec", "feedback_against", "contribution"),
        ):  # new keys at their defaults stay out, so existing runs keep their run ids
            if spec[section][key] == default:
                del spec[section][key]
        if spec["data"]["domain"] == "":
            del spec["data"]["domain"]
        if self.file_digests:
            spec["files"] = dict(sorted(self.file_digests.items()))
        if self.run.algorithm == "ensemble":
            # Experts differ by design: model, data, inner steps and the exchange settings are each expert's own.
            # What they share is the run (name, seed, algorithm) and who may join it (admission, robust).
            for section in ("model", "data", "inner", "outer", "noloco", "streaming", "codec"):
                del spec[section]
            spec.pop("files", None)
        spec["protocol"] = PROTOCOL
        return spec

    def spec_json(self) -> str:
        return json.dumps(self.spec(), sort_keys=True, separators=(",", ":"))

    def run_id(self) -> bytes:
        return hashlib.sha256(self.spec_json().encode()).digest()


def spec_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Dotted names of the fields that differ between two specs, e.g. ['inner.lr', 'codec.name']."""
    out: list[str] = []
    for section in sorted(set(mine) | set(theirs)):
        a, b = mine.get(section), theirs.get(section)
        if not isinstance(a, dict) or not isinstance(b, dict):
            if a != b:
                out.append(section)
            continue
        out.extend(f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
    return out


def _is_hex_key(text: str) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


INT_OR_AUTO = {"streaming.tau", "inner.rewarm_steps"}  # keys that take an int or the string "auto"


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Accept ints for float fields; refuse anything else that does not match the default's type."""
    if name in INT_OR_AUTO:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ConfigError(f'{name} must be "auto" or an int, got {value!r}')
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false")
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, type(default)) or isinstance(value, bool) != isinstance(default, bool):
        raise ConfigError(f"{name} must be of type {type(default).__name__}, got {value!r}")
    return value
