"""Names <-> wire enums for the TensorHeader fields that revision 1 sent as strings (codec, kind).

Code inside peerd speaks in names ("int4", "reduce"); the wire carries the proto enums. The conversion lives here
only, and an unknown or unset value from the wire becomes "" so the caller refuses it like any wrong name.
"""

from __future__ import annotations

from peerd.v1 import peerd_pb2 as pb

_KINDS = {
    "reduce": pb.TENSOR_KIND_REDUCE,
    "gather": pb.TENSOR_KIND_GATHER,
    "phi": pb.TENSOR_KIND_PHI,
    "pair": pb.TENSOR_KIND_PAIR,
    "mix": pb.TENSOR_KIND_MIX,
    "relay": pb.TENSOR_KIND_RELAY,
    "sponsored": pb.TENSOR_KIND_SPONSORED,
    "pull": pb.TENSOR_KIND_PULL,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


def codec_to_wire(name: str) -> int:
    """The Codec enum value of a codec name (ValueError for a name the proto does not list)."""
    return pb.Codec.Value(f"CODEC_{name.upper()}")


def codec_name(value: int) -> str:
    """The codec name of a Codec enum value from the wire; "" for CODEC_UNSPECIFIED or a value we do not know."""
    if value == pb.CODEC_UNSPECIFIED or value not in pb.Codec.values():
        return ""
    return pb.Codec.Name(value).removeprefix("CODEC_").lower()


def kind_to_wire(name: str) -> int:
    return _KINDS[name]


def kind_name(value: int) -> str:
    """The kind of a TensorKind enum value from the wire; "" for an unset or unknown one."""
    return _KIND_NAMES.get(value, "")
