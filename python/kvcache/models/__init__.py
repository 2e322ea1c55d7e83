"""Models that use the kvcache API."""

from .decoder import Decoder, StatefulDecoder, greedy_generate

__all__ = ["Decoder", "StatefulDecoder", "greedy_generate"]
