"""Structural JSON schemas for the custom resources the chart renders.

No Python package ships the Prometheus Operator's or KEDA's CRD schemas, so these list,
per kind, the fields of the CRD's OpenAPI schema the chart may use (with their types and
the enums and patterns that matter): a misspelt or misplaced field, a number where the CRD
wants a string (KEDA trigger metadata) or a deprecated field left out here (the Prometheus
Operator's ``bearerTokenSecret``) fails. Fields, types and patterns as in the CRDs of
prometheus-operator v0.93 (monitoring.coreos.com/v1) and KEDA v2.20 (keda.sh/v1alpha1); every
custom resource the examples render was also checked once against those CRDs' own
openAPIV3Schema (unknown fields made errors), which is not vendored here.
"""

from __future__ import annotations

from typing import Any

STR: dict[str, Any] = {"type": "string"}
BOOL: dict[str, Any] = {"type": "boolean"}
INT: dict[str, Any] = {"type": "integer"}
STR_MAP: dict[str, Any] = {"type": "object", "additionalProperties": STR}
# Prometheus durations as the Operator's CRDs pin them (no fractions, no "us").
UNITS = "".join(f"(([0-9]+){unit})?" for unit in ("y", "w", "d", "h", "m", "s", "ms"))
DURATION: dict[str, Any] = {"type": "string", "pattern": f"^(0|{UNITS})$"}
LABEL_NAME: dict[str, Any] = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}


def obj(required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(required),
        "properties": properties,
    }


def array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


METADATA = obj(
    ("name",),
    name={"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
    namespace=STR,
    labels=STR_MAP,
    annotations=STR_MAP,
)
LABEL_SELECTOR = obj(
    matchLabels=STR_MAP,
    matchExpressions=array(obj(("key", "operator"), key=STR, operator=STR, values=array(STR))),
)
NAMESPACE_SELECTOR = obj(any=BOOL, matchNames=array(STR))
SECRET_KEY = obj(("key",), name=STR, key=STR, optional=BOOL)
ACTIONS = ("replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
           "lowercase", "uppercase", "keepequal", "dropequal")  # fmt: skip
RELABEL = obj(
    sourceLabels=array(LABEL_NAME),
    separator=STR,
    targetLabel=STR,
    regex=STR,
    modulus=INT,
    replacement=STR,
    action={"enum": [c for a in ACTIONS for c in (a, a.capitalize())]},
)
# Shared by PodMonitor's podMetricsEndpoints and ServiceMonitor's endpoints.
ENDPOINT: dict[str, Any] = {
    "port": STR,
    "path": STR,
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "params": {"type": "object", "additionalProperties": array(STR)},
    "interval": DURATION,
    "scrapeTimeout": DURATION,
    "honorLabels": BOOL,
    "honorTimestamps": BOOL,
    "relabelings": array(RELABEL),
    "metricRelabelings": array(RELABEL),
    "authorization": obj(type=STR, credentials=SECRET_KEY),
    "basicAuth": obj(username=SECRET_KEY, password=SECRET_KEY),
    "tlsConfig": {"type": "object"},
    "followRedirects": BOOL,
    "enableHttp2": BOOL,
}

# Shared by both monitors' specs.
MONITOR: dict[str, Any] = {
    "selector": LABEL_SELECTOR,
    "namespaceSelector": NAMESPACE_SELECTOR,
    "jobLabel": STR,
    "podTargetLabels": array(STR),
    "sampleLimit": INT,
}

SPECS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): obj(
        ("selector",),
        **MONITOR,
        podMetricsEndpoints=array(obj(**ENDPOINT, portNumber=INT, filterRunning=BOOL)),
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): obj(
        ("selector",),
        **MONITOR,
        targetLabels=array(STR),
        endpoints=array(obj(**ENDPOINT, targetPort={"type": ["integer", "string"]})),
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): obj(
        groups=array(
            obj(
                ("name",),
                name={"type": "string", "minLength": 1},
                interval=DURATION,
                limit=INT,
                labels=STR_MAP,
                rules=array(
                    {
                        **obj(
                            ("expr",),
                            alert=STR,
                            record=STR,
                            expr={"type": ["string", "integer"]},
                            labels=STR_MAP,
                            annotations=STR_MAP,
                            keep_firing_for=DURATION,
                            **{"for": DURATION},
                        ),
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                    }
                ),
            )
        )
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): obj(
        ("scaleTargetRef", "triggers"),
        scaleTargetRef=obj(
            ("name",), name=STR, apiVersion=STR, kind=STR, envSourceContainerName=STR
        ),
        pollingInterval=INT,
        cooldownPeriod=INT,
        initialCooldownPeriod=INT,
        idleReplicaCount=INT,
        minReplicaCount=INT,
        maxReplicaCount=INT,
        fallback=obj(("failureThreshold", "replicas"), failureThreshold=INT, replicas=INT),
        advanced={"type": "object"},
        triggers={
            **array(
                obj(
                    ("type", "metadata"),
                    type=STR,
                    name=STR,
                    metadata=STR_MAP,  # KEDA reads every metadata value as a string
                    metricType={"enum": ["AverageValue", "Value", "Utilization"]},
                    useCachedMetrics=BOOL,
                    authenticationRef=obj(("name",), name=STR, kind=STR),
                )
            ),
            "minItems": 1,
        },
    ),
}


def schema_of(api_version: str, kind: str) -> dict[str, Any] | None:
    """The whole object's schema, or None for a kind listed here."""
    spec = SPECS.get((api_version, kind))
    if spec is None:
        return None
    return obj(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": api_version},
        kind={"const": kind},
        metadata=METADATA,
        spec=spec,
    )
