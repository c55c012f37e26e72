"""``tier-priority-admission``: pool-level admission by tier and quota classification.

Input: a message carrying the ``tier`` label (interactive / async / batch) and the
``classification`` label stamped by a queue-level classifying ``redis-quota``. Output:
CONTINUE while the inner saturation gate admits; when it refuses (saturated): WAIT for
reserved traffic, DROP with a 429 payload for interactive overflow, REFUSE otherwise.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from async_processor.gates.base import (
    CONTINUE,
    GATES,
    REFUSE,
    WAIT,
    Action,
    Gate,
    GateContext,
    Releases,
    Verdict,
)
from async_processor.gates.basic import build_inner
from async_processor.gates.params import GateSpec, Params, Str, json_object
from async_processor.gates.shared import InnerGate
from async_processor.messages import OVERFLOW, RESERVED, Envelope, Result, classification

# Exactly the reference's payload, spaces included.
TOO_MANY_REQUESTS = '{"error": "Too Many Requests", "code": 429}'


class TierParams(Params):
    saturation_gate: Str = Field(min_length=1)
    saturation_gate_params: Annotated[dict[str, Any], BeforeValidator(json_object)] = Field(
        default_factory=dict
    )
    tier_label: Str = "tier"


class TierPriorityAdmissionGate(InnerGate):
    failed = "saturation gate failed"

    def __init__(self, inner: Gate, tier_label: str) -> None:
        super().__init__(inner)
        self.tier_label = tier_label

    async def apply(self, message: Envelope, releases: Releases) -> Verdict:
        verdict = await self.apply_inner(message, releases)
        if verdict.action is not Action.REFUSE:
            return CONTINUE  # an inner WAIT or DROP does not mean saturated
        classified = classification(message)
        if classified == RESERVED:
            return WAIT
        interactive = message.routing.labels.get(self.tier_label) == "interactive"
        if interactive and classified == OVERFLOW:
            return Verdict(Action.DROP, Result(id=message.id, payload=TOO_MANY_REQUESTS))
        return REFUSE


@GATES.register("tier-priority-admission", TierParams)
def _tiers(params: TierParams, ctx: GateContext) -> Gate:
    spec = GateSpec(gate_type=params.saturation_gate, gate_params=params.saturation_gate_params)
    return TierPriorityAdmissionGate(
        build_inner(spec, ctx, "tier-priority-admission"), params.tier_label
    )
