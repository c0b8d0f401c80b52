"""The three token mixers of the hybrid layout: linear (L), sliding-window (S) and global gated MLA (G)."""

from model.attention.linear import LinearAttention
from model.attention.mla import GatedMLA
from model.attention.sliding import SlidingWindowAttention

__all__ = ["LinearAttention", "GatedMLA", "SlidingWindowAttention"]
