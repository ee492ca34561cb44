"""The single exception type of the codec layer, so callers can treat every bad frame the same way."""

from __future__ import annotations


class CodecError(ValueError):
    """Raised for bad input to ``encode`` and for every frame ``decode`` refuses (truncated, corrupt, lying)."""
