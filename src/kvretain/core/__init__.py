"""kvretain.core: blocks, prefix hashing, the retention API and eviction policies. Plain Python, no torch.

Public contract::

    BlockHasher                 chained sha256/xxhash hashes of full blocks (cache_salt, LoRA id)
    RetentionConfig, ...        retention directives, decode priority, scope; PriorityMapping
    make_policy(name, n, cfg)   an EvictionPolicy from the POLICIES registry (lru, lfu, priority, unified, belady)
    BlockPool                   reference counts, hash index, leaf tracking, eviction through the policy
    KVCacheManager              vLLM-shaped: get_computed_blocks / allocate_slots (None = no room) / free
"""

from kvretain.core.block_pool import BlockPool, PoolIntegrityError
from kvretain.core.hashing import BlockHash, BlockHasher, ExtraKeys
from kvretain.core.kv_cache_manager import CacheRequest, KVCacheManager
from kvretain.core.policy import POLICIES, EvictionPolicy, PolicyConfig, make_policy, policy_names
from kvretain.core.retention import (
    DEFAULT_RETENTION_PRIORITY,
    BlockRetention,
    PriorityMapping,
    RetentionConfig,
    RetentionDirective,
    RetentionError,
)

__all__ = [
    "DEFAULT_RETENTION_PRIORITY",
    "POLICIES",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRetention",
    "CacheRequest",
    "EvictionPolicy",
    "ExtraKeys",
    "KVCacheManager",
    "PolicyConfig",
    "PoolIntegrityError",
    "PriorityMapping",
    "RetentionConfig",
    "RetentionDirective",
    "RetentionError",
    "make_policy",
    "policy_names",
]
