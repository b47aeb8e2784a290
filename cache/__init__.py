"""Host-side structures of the scheduler over token ids: prefix caches and their key encoding."""

from cache.base import MatchResult, PrefixCache, PrefixMatcher, RadixNode
from cache.chunk import ChunkCache
from cache.keys import token_array
from cache.prefix_set import PrefixSet
from cache.radix import RadixCache

__all__ = ["ChunkCache", "MatchResult", "PrefixCache", "PrefixMatcher", "PrefixSet", "RadixCache", "RadixNode", "token_array"]
