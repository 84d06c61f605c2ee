"""Workloads: trace loaders, synthetic generators and priority tagging, all torch-free.

Every workload is a list of ``WorkloadRequest`` sorted by arrival, with lazy ``TokenSeq`` prompts.
"""

from kvretain.core.retention import RetentionDirective
from kvretain.workloads.azure import load_azure
from kvretain.workloads.mooncake import TraceError, TraceRecord, load_mooncake, read_trace
from kvretain.workloads.multi_tenant import MultiTenantConfig, generate_multi_tenant
from kvretain.workloads.priority import PRIORITY_RULES, PriorityRule, make_rule, tag_priorities
from kvretain.workloads.request import WorkloadError, WorkloadRequest, scale_and_limit
from kvretain.workloads.sources import WORKLOADS
from kvretain.workloads.tokens import LiteralChunk, SeededChunk, TokenSeq
from kvretain.workloads.working_set import WorkingSet, working_set

__all__ = [
    "PRIORITY_RULES",
    "WORKLOADS",
    "LiteralChunk",
    "MultiTenantConfig",
    "PriorityRule",
    "RetentionDirective",
    "SeededChunk",
    "TokenSeq",
    "TraceError",
    "TraceRecord",
    "WorkingSet",
    "WorkloadError",
    "WorkloadRequest",
    "generate_multi_tenant",
    "load_azure",
    "load_mooncake",
    "make_rule",
    "read_trace",
    "scale_and_limit",
    "tag_priorities",
    "working_set",
]
