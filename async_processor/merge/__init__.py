"""Merge policies: a pool's queue streams in, one bounded stream per pool out.

``build_merge_policy`` turns the ``--request-merge-policy-config-file`` config into a
policy; importing the policy modules here registers them in ``MERGE_POLICIES``.
"""

from __future__ import annotations

from async_processor.config import MergePolicyConfig
from async_processor.merge import random_robin, tier_priority, weighted_fair
from async_processor.merge.base import MERGE_POLICIES, MergeContext, MergePolicy

__all__ = ["MERGE_POLICIES", "MergeContext", "MergePolicy", "build_merge_policy"]

_POLICY_MODULES = (random_robin, tier_priority, weighted_fair)  # imported for their registrations


def build_merge_policy(config: MergePolicyConfig, ctx: MergeContext) -> MergePolicy:
    """The configured policy; an unknown type or bad parameter is a one-line ConfigError."""
    return MERGE_POLICIES.build(config.type, config.parameters, ctx)
