"""The simulator's Prometheus series, computed at scrape time from its live counts.

What the prometheus-budget / -saturation PromQL and the endpoint-scrape gate read (vLLM
and EPP names); ``Simulator`` registers one ``SimCollector``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from async_processor.gates import epp
from async_processor.sim.config import SimConfig, SimView


class SimCollector(Collector):
    """Gauges computed at scrape time from the live counts (nothing to update per request).

    Names and labels are what the prometheus-budget / -saturation PromQL and the
    endpoint-scrape gate read: vLLM series carry ``model_name`` and a relabelled
    ``inference_pool``; EPP pool series carry ``name``; flow-control series carry
    ``inference_pool``. The queue sizes are the waiting requests, split over the pods.
    EPP series use the current ``llm_d_epp_*`` names, the legacy ones or both
    (``epp_metrics``), as llm-d-router v0.9+, older EPPs or dual-emitting ones do.
    """

    def __init__(self, sim: SimView) -> None:
        self._sim = sim

    def collect(self) -> Iterator[GaugeMetricFamily]:
        c, load = self._sim.config, self._sim.load()
        vllm = self._sim.vllm_labels()
        # A pool model reports each pod (label ``pod``); the fixed model one pool-wide series.
        pods_vllm = [({**vllm, "pod": pod} if pod else vllm, r, w) for pod, r, w in load.per_pod]
        yield _gauge(
            "vllm:num_requests_running", "Requests running.", [(v, r) for v, r, _ in pods_vllm]
        )
        yield _gauge(
            "vllm:num_requests_waiting", "Requests waiting.", [(v, w) for v, _, w in pods_vllm]
        )
        pods = len(load.per_pod) if self._sim.pool else c.ready_pods
        for legacy in _EPP_NAMES[c.epp_metrics]:
            yield from _epp_series(c, legacy, pods, load.waiting, load.saturation)


_EPP_NAMES = {"current": (False,), "legacy": (True,), "both": (False, True)}


def _epp_series(
    c: SimConfig, legacy: bool, pods: int, waiting: float, saturation: float
) -> Iterator[GaugeMetricFamily]:
    """The EPP's pool and flow-control gauges under the current or the legacy names."""

    def name(metric: epp.EppMetric) -> str:
        return metric.legacy if legacy else metric.current

    pool = {"name": c.pool, "namespace": c.namespace}
    flow = {"inference_pool": c.pool, "model_name": c.model, "namespace": c.namespace}
    endpoint = "model_server_pod" if legacy else "model_server_endpoint"
    per_pod = [({**pool, endpoint: f"sim-{i}"}, waiting / pods) for i in range(pods)]
    yield _gauge(name(epp.READY_ENDPOINTS), "Ready endpoints in the pool.", [(pool, pods)])
    yield _gauge(name(epp.PER_ENDPOINT_QUEUE_SIZE), "Queued requests per endpoint.", per_pod)
    yield _gauge(name(epp.FLOW_CONTROL_QUEUE_SIZE), "Flow-control queue.", [(flow, waiting)])
    yield _gauge(
        name(epp.POOL_SATURATION),
        "Running / capacity, 0..1.",
        [({"inference_pool": c.pool, "namespace": c.namespace}, saturation)],
    )


def _gauge(
    name: str, doc: str, series: Iterable[tuple[dict[str, str], float]]
) -> GaugeMetricFamily:
    series = list(series)
    labels = list(series[0][0]) if series else []
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in series:
        family.add_metric([values[k] for k in labels], value)
    return family
