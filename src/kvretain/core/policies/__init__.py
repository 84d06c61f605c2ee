"""Built-in eviction policies; importing this package registers them in ``POLICIES``."""

from kvretain.core.policies.arc import ARCPolicy
from kvretain.core.policies.belady import BeladyPolicy
from kvretain.core.policies.lfu import LFUPolicy
from kvretain.core.policies.lru import LRUPolicy
from kvretain.core.policies.priority import StrictPriorityPolicy
from kvretain.core.policies.s3fifo import S3FIFOPolicy
from kvretain.core.policies.unified import UnifiedPolicy

__all__ = [
    "ARCPolicy",
    "BeladyPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "StrictPriorityPolicy",
    "UnifiedPolicy",
]
