"""Merge policies: a pool's queue streams in, one bounded stream per pool out.

``build_merge_policy`` turns the ``--request-merge-policy-config-file`` config into a
policy; ``MERGE_POLICIES`` imports the policy modules at its first lookup.
"""

from __future__ import annotations

from async_processor.config import MergePolicyConfig
from async_processor.merge.base import MERGE_POLICIES, MergeContext, MergePolicy, Source

__all__ = [
    "MERGE_POLICIES",
    "MergeContext",
    "MergePolicy",
    "Source",
    "build_merge_policy",
]


def build_merge_policy(config: MergePolicyConfig, ctx: MergeContext) -> MergePolicy:
    """The configured policy; an unknown type or bad parameter is a one-line ConfigError."""
    return MERGE_POLICIES.build(config.type, config.parameters, ctx)
