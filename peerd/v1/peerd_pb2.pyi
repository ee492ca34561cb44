from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_FP8: _ClassVar[Codec]
    CODEC_E3M0: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_SPARSE: _ClassVar[Codec]

class TensorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_KIND_UNSPECIFIED: _ClassVar[TensorKind]
    TENSOR_KIND_REDUCE: _ClassVar[TensorKind]
    TENSOR_KIND_GATHER: _ClassVar[TensorKind]
    TENSOR_KIND_PHI: _ClassVar[TensorKind]
    TENSOR_KIND_PAIR: _ClassVar[TensorKind]
    TENSOR_KIND_MIX: _ClassVar[TensorKind]
    TENSOR_KIND_RELAY: _ClassVar[TensorKind]
    TENSOR_KIND_SPONSORED: _ClassVar[TensorKind]
    TENSOR_KIND_PULL: _ClassVar[TensorKind]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_FP8: Codec
CODEC_E3M0: Codec
CODEC_INT4: Codec
CODEC_SPARSE: Codec
TENSOR_KIND_UNSPECIFIED: TensorKind
TENSOR_KIND_REDUCE: TensorKind
TENSOR_KIND_GATHER: TensorKind
TENSOR_KIND_PHI: TensorKind
TENSOR_KIND_PAIR: TensorKind
TENSOR_KIND_MIX: TensorKind
TENSOR_KIND_RELAY: TensorKind
TENSOR_KIND_SPONSORED: TensorKind
TENSOR_KIND_PULL: TensorKind

class Auth(_message.Message):
    __slots__ = ("run_id", "public_key", "timestamp_ms", "nonce", "signature", "admission")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    run_id: bytes
    public_key: bytes
    timestamp_ms: int
    nonce: bytes
    signature: bytes
    admission: bytes
    def __init__(self, run_id: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., timestamp_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., admission: _Optional[bytes] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "public_key", "address", "metrics_address", "heartbeat", "outer_step", "state_digest", "left", "incarnation", "suspects", "tls_cert", "work", "finished", "signature", "part_digests", "beat_base", "beat_proof", "outbound_only", "relay", "relays", "unreachable", "slow", "faulty", "phase_ms", "sponsor")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PART_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    BEAT_BASE_FIELD_NUMBER: _ClassVar[int]
    BEAT_PROOF_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_ONLY_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    SLOW_FIELD_NUMBER: _ClassVar[int]
    FAULTY_FIELD_NUMBER: _ClassVar[int]
    PHASE_MS_FIELD_NUMBER: _ClassVar[int]
    SPONSOR_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    public_key: bytes
    address: str
    metrics_address: str
    heartbeat: int
    outer_step: int
    state_digest: bytes
    left: bool
    incarnation: int
    suspects: _containers.RepeatedScalarFieldContainer[str]
    tls_cert: bytes
    work: int
    finished: bool
    signature: bytes
    part_digests: _containers.RepeatedScalarFieldContainer[bytes]
    beat_base: int
    beat_proof: bytes
    outbound_only: bool
    relay: str
    relays: bool
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    slow: _containers.RepeatedScalarFieldContainer[str]
    faulty: _containers.RepeatedScalarFieldContainer[str]
    phase_ms: int
    sponsor: str
    def __init__(self, peer_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., heartbeat: _Optional[int] = ..., outer_step: _Optional[int] = ..., state_digest: _Optional[bytes] = ..., left: _Optional[bool] = ..., incarnation: _Optional[int] = ..., suspects: _Optional[_Iterable[str]] = ..., tls_cert: _Optional[bytes] = ..., work: _Optional[int] = ..., finished: _Optional[bool] = ..., signature: _Optional[bytes] = ..., part_digests: _Optional[_Iterable[bytes]] = ..., beat_base: _Optional[int] = ..., beat_proof: _Optional[bytes] = ..., outbound_only: _Optional[bool] = ..., relay: _Optional[str] = ..., relays: _Optional[bool] = ..., unreachable: _Optional[_Iterable[str]] = ..., slow: _Optional[_Iterable[str]] = ..., faulty: _Optional[_Iterable[str]] = ..., phase_ms: _Optional[int] = ..., sponsor: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("auth", "self", "run_spec_json", "dialed_address")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SELF_FIELD_NUMBER: _ClassVar[int]
    RUN_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    DIALED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    self: PeerInfo
    run_spec_json: str
    dialed_address: str
    def __init__(self_, auth: _Optional[_Union[Auth, _Mapping]] = ..., self: _Optional[_Union[PeerInfo, _Mapping]] = ..., run_spec_json: _Optional[str] = ..., dialed_address: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("run_id", "peers", "observed_address")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    run_id: bytes
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    observed_address: str
    def __init__(self, run_id: _Optional[bytes] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., observed_address: _Optional[str] = ...) -> None: ...

class GossipRequest(_message.Message):
    __slots__ = ("auth", "peers", "to")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    to: str
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., to: _Optional[str] = ...) -> None: ...

class GossipResponse(_message.Message):
    __slots__ = ("peers", "observed_address")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    observed_address: str
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., observed_address: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("auth", "address", "nonce", "tls_cert")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    address: str
    nonce: bytes
    tls_cert: bytes
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., address: _Optional[str] = ..., nonce: _Optional[bytes] = ..., tls_cert: _Optional[bytes] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("result", "address", "observed_address")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    result: str
    address: str
    observed_address: str
    def __init__(self, result: _Optional[str] = ..., address: _Optional[str] = ..., observed_address: _Optional[str] = ...) -> None: ...

class ProbeEchoRequest(_message.Message):
    __slots__ = ("run_id", "nonce")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    run_id: bytes
    nonce: bytes
    def __init__(self, run_id: _Optional[bytes] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ProbeEchoResponse(_message.Message):
    __slots__ = ("signature",)
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    signature: bytes
    def __init__(self, signature: _Optional[bytes] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("auth", "self")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    SELF_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    self: PeerInfo
    def __init__(self_, auth: _Optional[_Union[Auth, _Mapping]] = ..., self: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("auth",)
    AUTH_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("step", "algorithm", "included", "expected", "partial", "raw_bytes", "wire_bytes", "seconds", "note", "fragment", "tokens", "leader", "no_shards", "part_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    NO_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    algorithm: str
    included: _containers.RepeatedScalarFieldContainer[str]
    expected: _containers.RepeatedScalarFieldContainer[str]
    partial: bool
    raw_bytes: int
    wire_bytes: int
    seconds: float
    note: str
    fragment: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    leader: str
    no_shards: _containers.RepeatedScalarFieldContainer[str]
    part_bytes: int
    def __init__(self, step: _Optional[int] = ..., algorithm: _Optional[str] = ..., included: _Optional[_Iterable[str]] = ..., expected: _Optional[_Iterable[str]] = ..., partial: _Optional[bool] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., note: _Optional[str] = ..., fragment: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., leader: _Optional[str] = ..., no_shards: _Optional[_Iterable[str]] = ..., part_bytes: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "peer_id", "address", "algorithm", "codec", "outer_step", "inner_step", "loss", "eval_loss", "tokens_per_second", "peers", "alive", "last_round", "bytes_sent_raw", "bytes_sent_wire", "bytes_received_wire", "compute_idle_seconds", "compute_seconds", "rounds_partial", "rounds_failed", "rejected_messages", "solo_steps", "recent_rounds", "finished", "state", "history", "redacted", "banned", "rejected_contributions", "work", "state_downloads", "forks_healed", "alone_since", "expected", "reachability", "relayed_bytes", "steps_sat_out")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_RAW_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_WIRE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_WIRE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SOLO_STEPS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    REDACTED_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOADS_FIELD_NUMBER: _ClassVar[int]
    FORKS_HEALED_FIELD_NUMBER: _ClassVar[int]
    ALONE_SINCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_SAT_OUT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peer_id: str
    address: str
    algorithm: str
    codec: str
    outer_step: int
    inner_step: int
    loss: float
    eval_loss: float
    tokens_per_second: float
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    alive: _containers.RepeatedScalarFieldContainer[str]
    last_round: RoundSummary
    bytes_sent_raw: int
    bytes_sent_wire: int
    bytes_received_wire: int
    compute_idle_seconds: float
    compute_seconds: float
    rounds_partial: int
    rounds_failed: int
    rejected_messages: int
    solo_steps: int
    recent_rounds: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    finished: bool
    state: str
    history: _containers.RepeatedCompositeFieldContainer[OuterStepRecord]
    redacted: bool
    banned: _containers.RepeatedScalarFieldContainer[str]
    rejected_contributions: int
    work: int
    state_downloads: int
    forks_healed: int
    alone_since: str
    expected: _containers.RepeatedScalarFieldContainer[str]
    reachability: str
    relayed_bytes: int
    steps_sat_out: int
    def __init__(self, run_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., address: _Optional[str] = ..., algorithm: _Optional[str] = ..., codec: _Optional[str] = ..., outer_step: _Optional[int] = ..., inner_step: _Optional[int] = ..., loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., alive: _Optional[_Iterable[str]] = ..., last_round: _Optional[_Union[RoundSummary, _Mapping]] = ..., bytes_sent_raw: _Optional[int] = ..., bytes_sent_wire: _Optional[int] = ..., bytes_received_wire: _Optional[int] = ..., compute_idle_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., rounds_partial: _Optional[int] = ..., rounds_failed: _Optional[int] = ..., rejected_messages: _Optional[int] = ..., solo_steps: _Optional[int] = ..., recent_rounds: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ..., finished: _Optional[bool] = ..., state: _Optional[str] = ..., history: _Optional[_Iterable[_Union[OuterStepRecord, _Mapping]]] = ..., redacted: _Optional[bool] = ..., banned: _Optional[_Iterable[str]] = ..., rejected_contributions: _Optional[int] = ..., work: _Optional[int] = ..., state_downloads: _Optional[int] = ..., forks_healed: _Optional[int] = ..., alone_since: _Optional[str] = ..., expected: _Optional[_Iterable[str]] = ..., reachability: _Optional[str] = ..., relayed_bytes: _Optional[int] = ..., steps_sat_out: _Optional[int] = ...) -> None: ...

class OuterStepRecord(_message.Message):
    __slots__ = ("outer_step", "loss", "eval_loss", "tokens_per_second")
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    loss: float
    eval_loss: float
    tokens_per_second: float
    def __init__(self, outer_step: _Optional[int] = ..., loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., tokens_per_second: _Optional[float] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("auth", "step", "attempt", "suspects", "fragment", "failed_round", "work", "state_digest", "tokens", "declined", "members_base", "carries")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FAILED_ROUND_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_BASE_FIELD_NUMBER: _ClassVar[int]
    CARRIES_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    step: int
    attempt: int
    suspects: _containers.RepeatedScalarFieldContainer[str]
    fragment: int
    failed_round: bytes
    work: int
    state_digest: bytes
    tokens: int
    declined: _containers.RepeatedScalarFieldContainer[str]
    members_base: bytes
    carries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., suspects: _Optional[_Iterable[str]] = ..., fragment: _Optional[int] = ..., failed_round: _Optional[bytes] = ..., work: _Optional[int] = ..., state_digest: _Optional[bytes] = ..., tokens: _Optional[int] = ..., declined: _Optional[_Iterable[str]] = ..., members_base: _Optional[bytes] = ..., carries: _Optional[_Iterable[str]] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("round_id", "step", "attempt", "members", "expected", "fragment", "leader", "tokens", "no_shards", "join_lag_ms", "part_bytes", "carried", "carried_by")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_SHARDS_FIELD_NUMBER: _ClassVar[int]
    JOIN_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    CARRIED_BY_FIELD_NUMBER: _ClassVar[int]
    round_id: bytes
    step: int
    attempt: int
    members: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    expected: _containers.RepeatedScalarFieldContainer[str]
    fragment: int
    leader: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    no_shards: _containers.RepeatedScalarFieldContainer[str]
    join_lag_ms: _containers.RepeatedScalarFieldContainer[int]
    part_bytes: int
    carried: _containers.RepeatedScalarFieldContainer[str]
    carried_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round_id: _Optional[bytes] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., members: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., expected: _Optional[_Iterable[str]] = ..., fragment: _Optional[int] = ..., leader: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., no_shards: _Optional[_Iterable[str]] = ..., join_lag_ms: _Optional[_Iterable[int]] = ..., part_bytes: _Optional[int] = ..., carried: _Optional[_Iterable[str]] = ..., carried_by: _Optional[_Iterable[str]] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("group", "behind", "redirect", "delta", "behind_ms")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BEHIND_MS_FIELD_NUMBER: _ClassVar[int]
    group: Group
    behind: int
    redirect: PeerInfo
    delta: GroupDelta
    behind_ms: int
    def __init__(self, group: _Optional[_Union[Group, _Mapping]] = ..., behind: _Optional[int] = ..., redirect: _Optional[_Union[PeerInfo, _Mapping]] = ..., delta: _Optional[_Union[GroupDelta, _Mapping]] = ..., behind_ms: _Optional[int] = ...) -> None: ...

class GroupDelta(_message.Message):
    __slots__ = ("group", "base", "dropped")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    group: Group
    base: bytes
    dropped: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group: _Optional[_Union[Group, _Mapping]] = ..., base: _Optional[bytes] = ..., dropped: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("auth", "round_id", "shard", "numel", "wire_bytes", "included", "codec", "kind", "part", "included_mask", "to_incarnation", "base_step", "tokens")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_MASK_FIELD_NUMBER: _ClassVar[int]
    TO_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BASE_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    round_id: bytes
    shard: int
    numel: int
    wire_bytes: int
    included: _containers.RepeatedScalarFieldContainer[str]
    codec: Codec
    kind: TensorKind
    part: int
    included_mask: bytes
    to_incarnation: int
    base_step: int
    tokens: int
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., round_id: _Optional[bytes] = ..., shard: _Optional[int] = ..., numel: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., included: _Optional[_Iterable[str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., kind: _Optional[_Union[TensorKind, str]] = ..., part: _Optional[int] = ..., included_mask: _Optional[bytes] = ..., to_incarnation: _Optional[int] = ..., base_step: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class TensorTrailer(_message.Message):
    __slots__ = ("digest", "signature")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    signature: bytes
    def __init__(self, digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class TensorMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "body", "seal")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    chunk: bytes
    trailer: TensorTrailer
    body: bytes
    seal: TensorTrailer
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., trailer: _Optional[_Union[TensorTrailer, _Mapping]] = ..., body: _Optional[bytes] = ..., seal: _Optional[_Union[TensorTrailer, _Mapping]] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("auth", "step", "group_size")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    step: int
    group_size: int
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., step: _Optional[int] = ..., group_size: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("accepted", "round_id", "members", "step", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    round_id: bytes
    members: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    step: int
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., round_id: _Optional[bytes] = ..., members: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AverageRequest(_message.Message):
    __slots__ = ("auth", "step")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    step: int
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class SponsorResponse(_message.Message):
    __slots__ = ("included_step", "reason", "held_ms")
    INCLUDED_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HELD_MS_FIELD_NUMBER: _ClassVar[int]
    included_step: int
    reason: str
    held_ms: int
    def __init__(self, included_step: _Optional[int] = ..., reason: _Optional[str] = ..., held_ms: _Optional[int] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("auth", "peers")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    peers: int
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., peers: _Optional[int] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, started: _Optional[_Iterable[str]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("auth", "min_step", "ranges")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    min_step: int
    ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., min_step: _Optional[int] = ..., ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("outer_step", "tensors", "total_bytes", "state_digest", "work", "ranges", "next_digest", "lineage")
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    outer_step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    state_digest: bytes
    work: int
    ranges: _containers.RepeatedScalarFieldContainer[int]
    next_digest: bytes
    lineage: _containers.RepeatedCompositeFieldContainer[StepDigest]
    def __init__(self, outer_step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., state_digest: _Optional[bytes] = ..., work: _Optional[int] = ..., ranges: _Optional[_Iterable[int]] = ..., next_digest: _Optional[bytes] = ..., lineage: _Optional[_Iterable[_Union[StepDigest, _Mapping]]] = ...) -> None: ...

class StepDigest(_message.Message):
    __slots__ = ("step", "digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    digest: bytes
    def __init__(self, step: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class StateMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    chunk: bytes
    trailer: TensorTrailer
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., trailer: _Optional[_Union[TensorTrailer, _Mapping]] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("auth", "target", "method", "call", "payload", "end", "error")
    AUTH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    auth: Auth
    target: str
    method: str
    call: int
    payload: bytes
    end: bool
    error: str
    def __init__(self, auth: _Optional[_Union[Auth, _Mapping]] = ..., target: _Optional[str] = ..., method: _Optional[str] = ..., call: _Optional[int] = ..., payload: _Optional[bytes] = ..., end: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
