"""Page-aligned radix-tree prefix cache over token ids, shared by the engine and the gateway.

Pure Python: token ids in, page ids and handles out. See :class:`RadixCache` for the contract.
"""

from radix_cache.cache import RadixCache
from radix_cache.tokens import PackedTokens, pack_tokens
from radix_cache.types import CacheStats, Handle, InsertResult, MatchResult

__all__ = ["CacheStats", "Handle", "InsertResult", "MatchResult", "PackedTokens", "RadixCache",
           "pack_tokens"]
