"""Built-in eviction policies; importing this package registers them in ``POLICIES``."""

from kvretain.core.policies.belady import BeladyPolicy
from kvretain.core.policies.lfu import LFUPolicy
from kvretain.core.policies.lru import LRUPolicy
from kvretain.core.policies.priority import StrictPriorityPolicy
from kvretain.core.policies.unified import UnifiedPolicy

__all__ = ["BeladyPolicy", "LFUPolicy", "LRUPolicy", "StrictPriorityPolicy", "UnifiedPolicy"]
