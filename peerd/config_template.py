"""The commented default run config that `peerd init` writes: every key with its default and what it does. Kept apart
from peerd/config.py (which parses and checks a config) because it is documentation, about a hundred lines of it."""

from __future__ import annotations

from pathlib import Path

from peerd.config import ConfigError

TEMPLATE = """\
# peerd run config. Every peer of a run uses the same file: the [run] .. [robust] sections hash into the run id,
# and a peer with a different spec is refused at Join (the error names the fields that differ).
# [network], [checkpoint] and [security] are local and may differ per machine.

[run]
name = "peerd-run"
algorithm = "diloco"      # diloco | streaming | noloco | ddp (every-step all-reduce baseline) | ensemble
seed = 0                  # all peers start from the same weights built from this seed
outer_steps = 0           # this peer stops after this many outer steps (0 = run until stopped); local
init_digest = ""          # sha256 of the weights file every peer starts from; `peerd start --init-from FILE` fills it

[model]
preset = "tiny"           # tiny (tests) | small (~10M) | medium (~30M) | base (~100M, GPUs)
factory = ""              # "package.module:factory" to plug in your own model (see README), e.g. "trainer.hf:causal_lm"
config = ""               # a file for the factory: trainer.hf:causal_lm reads a transformers config.json (no download)
# n_layer = 0, n_head = 0, d_model = 0, seq_len = 0 override the preset when non-zero

[data]
path = ""                 # directory of text files or a uint16 token file; "" = Python stdlib sources
factory = ""              # "package.module:factory" for your own data (see README)
tokenizer = ""            # a tokenizers tokenizer.json: text is trained as its ids (pip install 'peerd[hf]')
batch_size = 8
num_shards = 16           # the train stream is split into this many striped shards; each peer reads its own
eval_batches = 4          # held-out batches for the eval loss after each outer step

[inner]
steps = 20                # H: inner AdamW steps per outer step
lr = 1e-3
warmup_steps = 20
weight_decay = 0.1
grad_clip = 1.0
total_steps = 0           # >0: cosine-decay the inner lr to 10% by this inner step (part of the spec); 0: constant
window_s = 0.0            # diloco/streaming: >0 = train this many seconds per outer step (steps sized to speed)
rewarm_steps = "auto"     # warmup after --init-from, and after adopting a state 2+ outer steps ahead (1+ after a
                          # resume; fresh AdamW moments); "auto" = warmup_steps, 0 = never

[outer]                   # DiLoCo / Streaming DiLoCo outer Nesterov SGD
lr = 0.7
momentum = 0.9
late_work = "carry"       # a late peer's pseudo-gradient goes into its next round ("carry") or is dropped ("discard")
slow_link = "sponsor"     # diloco: a peer flagged slow for its link sends its work through a sponsor ("sponsor") or
                          # stays in every round ("wait")
sponsor_probe = 16        # sponsored contributions before it rejoins rounds briefly to test its link (x2 each time
                          # the link is still slow; 0: never)
overlap = false           # diloco: train the next window while the round runs; its result lands a few steps late

[noloco]                  # used when run.algorithm = "noloco"
alpha = 0.5
beta = 0.7
gamma = 0.7
group_size = 2
max_staleness = 1
send_ahead = false

[streaming]               # used when run.algorithm = "streaming"
fragments = 2
mode = "strided"          # strided | sequential
tau = "auto"              # inner steps a fragment's exchange may overlap before its local merge; "auto": measured
alpha = 0.5               # local <- alpha*local + (1-alpha)*new_global
late_policy = "wait"      # wait | skip

[codec]
name = "fp32"             # fp32 | bf16 | int8 | fp8 | e3m0 | int4 | sparse (DiLoCo only, needs error_feedback)
zstd_level = 1            # 0 switches zstd off; otherwise each frame drops it when it does not pay
block_size = 256
error_feedback = false    # carry what the codec dropped into the next round (DiLoCo)
feedback_decay = 1.0      # share of the residual carried (< 1 with sparse: stands in for outer momentum)
feedback_against = "contribution"  # or "average": the residual is what the applied average lacks
density = 0.04            # sparse only: top ceil(density * block_size) values of each block are sent
bits = 2                  # sparse only: 2 | 4 | 8 bits per sent value

[admission]
mode = "open"             # open | secret | allowlist | invite (see SECURITY.md)
allowlist = []            # mode "allowlist": hex public keys (`peerd key --data-dir DIR` prints a peer's)
owner_key = ""            # mode "invite": the run owner's public key (`peerd owner-key FILE` makes one)

[robust]                  # poisoning defence, applied by each shard's owner before averaging
aggregation = "mean"      # mean | trimmed_mean | clipped_mean
max_norm_ratio = 10.0     # refuse contributions with a norm above this times the owner's own (0: off)
trim_fraction = 0.2       # trimmed_mean: share dropped at each end per coordinate (at least one of 3+)
clip_ratio = 2.0          # clipped_mean: clip each contribution to this times the median norm

[network]
gossip_interval = 1.0
gossip_entries = 8        # peer entries per gossip message: flat gossip cost per peer as the swarm grows
peer_timeout = 10.0
rendezvous_timeout = 30.0
round_timeout = 120.0
match_timeout = 10.0
chunk_bytes = 1048576
join_timeout = 60.0       # seconds `peerd start` retries bootstrap addresses where nothing answers
relay = true              # when reachable, relay NoLoCo exchanges for peers behind NAT (README: Behind NAT)
relay_max_peers = 16      # outbound-only peers that may attach at once
relay_peer_mbit = 100.0   # relayed traffic allowed per attached peer
start_barrier = true      # --wait-peers N: the N peers also take their first inner step together

[checkpoint]
every = 1

[security]                # local: never part of the run spec
join_secret_file = ""     # mode "secret": file (chmod 600) with the shared join secret
invite_file = ""          # mode "invite": this peer's invitation (`peerd invite ...`, chmod 600)
ban_after = 3             # invalid contributions within ban_window before a peer is banned
ban_window = 600.0
ban_seconds = 600.0
rate_limit = 200.0        # requests per second per peer
rate_burst = 400.0
max_streams_per_peer = 16
max_inflight_mb_per_peer = 256.0
read_timeout = 30.0       # a stream that sends nothing for this long is dropped (slow-loris)
"""


def write_template(path: str | Path) -> None:
    """Write a commented default config; refuse to overwrite an existing file."""
    p = Path(path)
    if p.exists():
        raise ConfigError(f"{p} already exists; not overwriting it")
    p.write_text(TEMPLATE)
