"""KV-cache service: block pools, block tables, prefix hashes, LRU and swap plans.

The mechanism only: it answers "can / cannot" and returns block ids and copy lists; the
scheduler owns the policy. No torch is imported here.
"""

from contracts.block_hash import hash_block
from kvcache_svc.block_pool import BlockPool, Tier
from kvcache_svc.manager import Allocated, Appended, KVCacheManager, NoFreeBlocks, PrefixHit

__all__ = ["Allocated", "Appended", "BlockPool", "KVCacheManager", "NoFreeBlocks", "PrefixHit", "Tier", "hash_block"]
