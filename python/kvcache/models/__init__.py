"""Models that use the kvcache API."""

from .decoder import Decoder, greedy_generate

__all__ = ["Decoder", "greedy_generate"]
