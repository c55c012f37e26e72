"""Merge stamping + dispatch request building + transforms, as the simulator receives them."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from async_processor.config import TransformConfig
from async_processor.config.queues import QueueSpec
from async_processor.merge.base import Source
from async_processor.merge.tier_priority import TierPriority, TierPriorityParams
from async_processor.messages import Envelope, Request, Routing
from async_processor.metrics import Metrics
from async_processor.pipeline.dispatch import DispatchSettings, build_request, send
from async_processor.transforms import build_transform_chain
from async_processor.transforms.base import TransformContext
from async_processor.transports.base import Delivery
from async_processor.work import Work
from tests.fixtures.inprocess import http_client
from tests.fixtures.simulator import SimulatorProcess

pytestmark = pytest.mark.anyio

FAIRNESS = "x-llm-d-inference-fairness-id"
TRANSFORMS = {
    "requestTransforms": [
        {
            "name": "batch-defaults",
            "type": "set_params",
            "parameters": {"default": {"max_tokens": 3}, "when_labels": {"tier": "batch"}},
        },
        {
            "name": "route",
            "type": "set_headers",
            "parameters": {"headers": {"x-tenant-tier": {"from_label": "tier"}}},
        },
    ]
}


def work(url: str, request_id: str, payload: bytes, labels: dict[str, str]) -> Work:
    spec = QueueSpec(id="q", name="q", igw_base_url=url, inference_objective="queue-objective")
    request = Request(
        id=request_id,
        deadline=2_000_000_000,
        payload=payload,
        metadata={"userid": "tenant-7"},
        # A message that sets the fairness or priority header itself is INVALID_REQUEST
        # (tests/integration/test_gateway_hardening.py), so only a header of its own here.
        headers={"x-caller": "c"},
    )
    return Work(
        delivery=Delivery(queue=spec, raw=b""),
        envelope=Envelope(request=request, routing=Routing(labels=labels)),
        metrics=Metrics().queue("q", "q", "p"),
    )


async def merged(items: list[Work]) -> list[Work]:
    params = TierPriorityParams(
        priority_header="x-gateway-priority", lane_objectives={"overflow-batch": "best-effort"}
    )
    send_side, receive_side = anyio.create_memory_object_stream[Work](len(items))
    for item in items:
        send_side.send_nowait(item)
    send_side.close()
    out, received = anyio.create_memory_object_stream[Work](len(items))
    await TierPriority(params).run("p", [Source(QueueSpec(id="q", name="q"), receive_side)], out)
    return [w async for w in received]


def named(headers: dict[str, str], name: str) -> list[str]:
    return [v for k, v in headers.items() if k.lower() == name]


async def test_stamped_headers_and_edited_body_reach_the_gateway(
    simulator: SimulatorProcess,
) -> None:
    batch_payload = b'{"model": "m",  "prompt": "p", "temperature": 1.50}'
    chat_payload = b'{"model":"m","prompt":"\\u003c","big":123456789012345678901234567890}'
    items = await merged(
        [
            work(simulator.url, "batch", batch_payload, {"tier": "batch"}),
            work(simulator.url, "chat", chat_payload, {"tier": "interactive"}),
        ]
    )
    chain = build_transform_chain(TransformConfig.model_validate(TRANSFORMS), TransformContext())
    async with http_client() as http:
        for item in items:
            out = build_request(item, DispatchSettings())
            await chain.apply(item.envelope, out)
            attempt = await send(http, out, timeout=10)
            assert attempt.status == 200
    recorded: dict[str, dict[str, Any]] = {
        named(r["headers"], "x-tenant-tier")[0]: r for r in simulator.requests()
    }

    batch, chat = recorded["batch"], recorded["interactive"]
    # set_params edits only the field it adds; the untouched payload is byte-for-byte.
    assert batch["body"] == '{"model": "m",  "prompt": "p", "temperature": 1.50,"max_tokens":3}'
    assert chat["body"] == chat_payload.decode()
    for r, lane in ((batch, "5"), (chat, "3")):
        headers = r["headers"]
        assert named(headers, FAIRNESS) == ["tenant-7"]
        assert named(headers, "x-gateway-priority") == [lane]
        assert named(headers, "x-gateway-inference-objective") == ["queue-objective"]
        assert named(headers, "x-caller") == ["c"]
        assert named(headers, "content-type") == ["application/json"]
    assert named(batch["headers"], "x-llm-d-inference-objective") == ["best-effort"]
    assert named(chat["headers"], "x-llm-d-inference-objective") == []
