"""The llm-d endpoint picker's (EPP) metric names the gates read: current and legacy.

Stage: gate configuration (no I/O). Input: nothing. Output: for each EPP series a gate
reads, its current name, the deprecated name it replaces and any label renamed on the
way, so the PromQL builders (``gates.prometheus``), the simulator and the docs agree.

llm-d-router v0.9.0 (the first release with the EPP code in its own tree, formerly
from gateway-api-inference-extension) exports every metric under ``llm_d_epp_`` and
still emits the old ``inference_extension_*`` / ``inference_pool_*`` twin of each
(dual emission). The old names are deprecated and due for removal (llm-d-router
#1070); EPPs built from gateway-api-inference-extension up to v1.5.0 (llm-d-router
up to v0.8.x) export only them. So every query asks for the current name first and
the legacy one as a fallback. See docs/gates.md ("EPP metric names").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EppMetric:
    current: str
    legacy: str

    @property
    def names(self) -> tuple[str, str]:
        return (self.current, self.legacy)


# {inference_pool}; since llm-d-router main after v0.10.0 also {stage}: prefill, decode
# and effective = max(prefill, decode). Legacy name from GIE v1.5.0.
POOL_SATURATION = EppMetric(
    "llm_d_epp_flow_control_pool_saturation", "inference_extension_flow_control_pool_saturation"
)
# {fairness_id, priority, inference_pool, model_name, target_model_name}; the legacy
# name has carried inference_pool since GIE v1.3.0.
FLOW_CONTROL_QUEUE_SIZE = EppMetric(
    "llm_d_epp_flow_control_queue_size", "inference_extension_flow_control_queue_size"
)
READY_ENDPOINTS = EppMetric("llm_d_epp_ready_endpoints", "inference_pool_ready_pods")  # {name}
# {name, model_server_endpoint}; the legacy name's label is model_server_pod.
PER_ENDPOINT_QUEUE_SIZE = EppMetric(
    "llm_d_epp_per_endpoint_queue_size", "inference_pool_per_pod_queue_size"
)
