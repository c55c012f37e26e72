"""The load-dependent pool model on virtual time: latency under load, queueing order,
priority and preemption, router shedding, per-class accounting."""

from __future__ import annotations

import pytest

from async_processor.sim.pool import BATCH, INTERACTIVE, Job, Pool, PoolConfig
from async_processor.sim.serving import config_from_args, request_class


def pool(**kw: object) -> Pool:
    base: dict[str, object] = {"pods": 1, "max_num_seqs": 1}
    return Pool(PoolConfig.model_validate({**base, **kw}))


def submit(
    p: Pool, at: float, cls: str = INTERACTIVE, prefill: float = 0.0, decode: float = 1.0
) -> Job:
    p.advance(at)
    job = Job(cls, prefill, decode, at)
    assert p.submit(job, shed_exempt=True)  # shedding has its own test
    return job


def test_an_idle_pod_answers_after_prefill_then_decode() -> None:
    p = pool()
    job = submit(p, 0.0, prefill=0.25, decode=1.0)
    assert p.advance(10.0) == [job]
    assert job.ttft == pytest.approx(0.25)
    assert job.finished == pytest.approx(1.25)


def test_work_is_the_prefill_overhead_plus_tokens_and_the_output_tokens() -> None:
    c = PoolConfig(prefill_overhead=0.1, prefill_time_per_token=0.001, inter_token_latency=0.02)
    assert c.work(100, 50) == pytest.approx((0.2, 1.0))


def test_load_factor_rises_linearly_to_the_time_factor_at_max_num_seqs() -> None:
    p = pool(max_num_seqs=3, time_factor_under_load=2.0)
    jobs = [submit(p, 0.0) for _ in range(3)]  # 3 of 3 slots: factor 2
    assert p.factor(p.pods[0]) == pytest.approx(2.0)
    p.advance(10.0)
    assert [j.finished for j in jobs] == pytest.approx([2.0, 2.0, 2.0])
    two = pool(max_num_seqs=3, time_factor_under_load=2.0)
    submit(two, 0.0), submit(two, 0.0)
    assert two.factor(two.pods[0]) == pytest.approx(1.5)


def test_the_factor_is_re_evaluated_when_a_neighbour_leaves() -> None:
    p = pool(max_num_seqs=2, time_factor_under_load=2.0)
    short, long = submit(p, 0.0, decode=1.0), submit(p, 0.0, decode=3.0)
    p.advance(100.0)
    assert short.finished == pytest.approx(2.0)  # both at factor 2
    assert long.finished == pytest.approx(4.0)  # 1 s of work done by t=2, then 2 s alone


def test_the_waiting_queue_is_fifo_and_waiting_counts_in_ttft() -> None:
    p = pool()
    jobs = [submit(p, 0.0, prefill=0.5, decode=0.5) for _ in range(3)]
    assert p.waiting() == 2
    p.advance(10.0)
    assert [j.finished for j in jobs] == pytest.approx([1.0, 2.0, 3.0])
    assert jobs[2].ttft == pytest.approx(2.5)


def test_priority_lets_interactive_jump_waiting_batch_work() -> None:
    p = pool(scheduling_policy="priority")
    submit(p, 0.0, BATCH)
    queued_batch = submit(p, 0.0, BATCH)
    interactive = submit(p, 0.1)
    p.advance(10.0)
    assert interactive.finished == pytest.approx(2.0)
    assert queued_batch.finished == pytest.approx(3.0)


def test_fcfs_keeps_arrival_order_whatever_the_class() -> None:
    p = pool(preemption=True)  # preemption needs the priority policy
    submit(p, 0.0, BATCH)
    queued_batch = submit(p, 0.0, BATCH)
    interactive = submit(p, 0.1)
    p.advance(10.0)
    assert (queued_batch.finished, interactive.finished) == pytest.approx((2.0, 3.0))
    assert p.counters.preempted[BATCH] == 0


def test_preemption_evicts_batch_which_loses_its_progress_and_its_slot_seconds() -> None:
    p = pool(scheduling_policy="priority", preemption=True)
    batch = submit(p, 0.0, BATCH)
    interactive = submit(p, 0.6)
    p.advance(10.0)
    assert interactive.finished == pytest.approx(1.6)  # no wait at all
    assert batch.preemptions == 1
    assert batch.finished == pytest.approx(2.6)  # restarted from zero after the interactive one
    assert p.counters.slot_seconds[BATCH] == pytest.approx(1.6)
    assert p.counters.completed_slot_seconds[BATCH] == pytest.approx(1.0)


def test_preemption_never_evicts_interactive_work() -> None:
    p = pool(scheduling_policy="priority", preemption=True)
    first = submit(p, 0.0)
    second = submit(p, 0.5)
    p.advance(10.0)
    assert (first.finished, second.finished) == pytest.approx((1.0, 2.0))


def test_the_router_picks_the_least_loaded_pod() -> None:
    p = pool(pods=3, max_num_seqs=4)
    for _ in range(5):
        submit(p, 0.0)
    assert sorted(len(pod.running) for pod in p.pods) == [1, 2, 2]


def test_only_batch_is_shed_and_only_when_every_pod_is_saturated() -> None:
    p = pool(pods=2, max_num_seqs=4, shed_kv_usage=0.75, shed_queue_depth=2)
    for _ in range(5):  # pods at 3/4 and 2/4 slots: one pod not saturated yet
        submit(p, 0.0)
    assert not p.saturated()
    assert p.submit(Job(BATCH, 0.0, 1.0, 0.0))
    assert p.saturated()  # 3/4 each: at the KV threshold
    assert not p.submit(Job(BATCH, 0.0, 1.0, 0.0))
    assert p.submit(Job(INTERACTIVE, 0.0, 1.0, 0.0))
    assert p.counters.shed == {BATCH: 1}
    assert p.saturation() == pytest.approx(1.0)


def test_a_cancelled_job_frees_its_slot_for_the_next() -> None:
    p = pool()
    gone, nxt = submit(p, 0.0), submit(p, 0.0)
    p.advance(0.5)
    p.cancel(gone)
    p.advance(10.0)
    assert gone.finished is None
    assert nxt.finished == pytest.approx(1.5)


def test_running_slot_seconds_are_counted_per_class() -> None:
    p = pool(max_num_seqs=2)
    submit(p, 0.0, BATCH, decode=2.0)
    submit(p, 0.0, INTERACTIVE, decode=1.0)
    p.advance(1.5)
    assert p.counters.slot_seconds[BATCH] == pytest.approx(1.5)
    assert p.counters.slot_seconds[INTERACTIVE] == pytest.approx(1.0)
    assert p.running(BATCH) == 1 and p.free_slots() == 1


def test_running_age_is_what_completion_will_count_for_the_time_so_far() -> None:
    p = pool(max_num_seqs=2)
    submit(p, 0.0, BATCH, decode=2.0)
    submit(p, 0.5, BATCH, decode=2.0)
    p.advance(1.5)
    assert p.running_age(BATCH) == pytest.approx(1.5 + 1.0)
    assert p.running_age(INTERACTIVE) == 0


@pytest.mark.parametrize(
    ("headers", "cls"),
    [
        ({}, INTERACTIVE),
        ({"x-gateway-priority": "-1"}, BATCH),
        ({"x-gateway-priority": "0"}, INTERACTIVE),
        ({"x-gateway-priority": "high"}, INTERACTIVE),
        ({"x-gateway-inference-objective": "batch"}, BATCH),
        ({"x-llm-d-inference-objective": "Sheddable"}, BATCH),
        ({"x-gateway-inference-objective": "chat"}, INTERACTIVE),
    ],
)
def test_requests_are_batch_when_their_priority_or_objective_says_so(
    headers: dict[str, str], cls: str
) -> None:
    assert request_class(headers) == cls


def test_pool_flags_need_max_num_seqs() -> None:
    with pytest.raises(ValueError, match="max-num-seqs"):
        config_from_args({"pods": 2, "max_num_seqs": None} | dict.fromkeys(
            ["prefill_overhead", "prefill_time_per_token", "inter_token_latency",
             "time_factor_under_load", "scheduling_policy", "shed_queue_depth",
             "shed_kv_usage", "preemption"]))  # fmt: skip
