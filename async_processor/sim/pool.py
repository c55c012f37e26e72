"""A load-dependent inference pool: the model behind ``async-processor sim --max-num-seqs``.

Stage: outside the daemon (simulator, benchmark oracle). Input: jobs (class, prefill and
decode work) submitted at a time the caller gives; output: when each job got its first
token and finished, or that the router shed it, plus the gauges a real pool exports.
The model is pure and clock-free: the caller passes ``now`` to every call, so the HTTP
simulator drives it with the wall clock and the benchmark's oracle with virtual time.

In the spirit of ``llm-d-inference-sim``: ``pods`` replicas behind one router that picks
the least-loaded pod; each pod runs at most ``max_num_seqs`` jobs and queues the rest
FIFO without limit (vLLM queues, it does not 429). With the ``priority`` policy
interactive jobs jump batch ones in the queue and, with ``preemption``, an interactive
job that finds no free slot evicts the latest-arrived running batch job, which loses its
progress and goes back to the head of the batch queue. A job's work runs at a speed
divided by the pod's load factor, 1 with one job running rising linearly to
``time_factor_under_load`` at ``max_num_seqs``, re-evaluated whenever the pod's running
count changes (between events the factor is constant, so progress is exact). Each pod
keeps one work clock (work done by any job running since the pod started) and a heap of
its jobs' next milestones on that clock, so an event costs O(log n), not O(slots).

The router sheds only sheddable (batch) jobs, and only when the whole pool is saturated
(every pod has ``shed_queue_depth`` waiting or a KV-cache use of ``shed_kv_usage``), as
llm-d's flow control does with its saturation detector. KV-cache use is modelled as the
share of a pod's slots in use, so the default threshold is 1.0 (every slot busy), not
llm-d's 0.8 of real KV blocks: at 0.8 of *slots* the router would shed batch work while a
fifth of the pool idles, and no daemon could reach what the oracle (never shed) fills.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

INTERACTIVE = "interactive"
BATCH = "batch"
CLASSES = (INTERACTIVE, BATCH)
EPSILON = 1e-9  # seconds of work: float noise when a milestone is reached exactly


class PoolConfig(BaseModel):
    """The pool's shape and timing (seconds); fixed for the simulator's life."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pods: int = Field(1, ge=1)
    max_num_seqs: int = Field(32, ge=1)
    prefill_overhead: float = Field(0.0, ge=0)
    prefill_time_per_token: float = Field(0.0, ge=0)
    inter_token_latency: float = Field(0.0, ge=0)
    time_factor_under_load: float = Field(1.0, ge=1.0)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    preemption: bool = False
    shed_queue_depth: int = Field(5, ge=1)
    shed_kv_usage: float = Field(1.0, gt=0, le=1)

    def work(self, prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
        """(prefill, decode) seconds of work at load factor 1."""
        prefill = self.prefill_overhead + prompt_tokens * self.prefill_time_per_token
        return prefill, output_tokens * self.inter_token_latency

    @property
    def capacity(self) -> int:
        return self.pods * self.max_num_seqs


@dataclass(eq=False)
class Job:
    """One request inside the pool; times are the caller's clock."""

    cls: str
    prefill: float
    decode: float
    arrived: float
    started: float = 0.0  # start of the current run (a preemption restarts it)
    mark: float = 0.0  # the pod's work clock when the current run started
    first_token: float | None = None
    finished: float | None = None
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived

    def _milestone(self) -> float:
        return self.prefill if self.first_token is None else self.prefill + self.decode


@dataclass
class Pod:
    name: str
    slots: int
    running: list[Job] = field(default_factory=list)
    # One FIFO per rank (0 first); fcfs uses rank 0 only.
    waiting: tuple[deque[Job], deque[Job]] = field(default_factory=lambda: (deque(), deque()))
    work: float = 0.0  # seconds of work each running job has done since the pod started
    by_class: Counter[str] = field(default_factory=Counter)
    # (work clock at the milestone, tie-breaker, job); stale entries are skipped lazily.
    _milestones: list[tuple[float, int, Job]] = field(default_factory=list)
    _seq: int = 0

    def start(self, job: Job) -> None:
        job.mark = self.work
        self.running.append(job)
        self.by_class[job.cls] += 1
        self.push(job)

    def stop(self, job: Job) -> None:
        self.running.remove(job)
        self.by_class[job.cls] -= 1

    def push(self, job: Job) -> None:
        self._seq += 1
        heapq.heappush(self._milestones, (job.mark + job._milestone(), self._seq, job))

    def next_milestone(self) -> tuple[float, Job] | None:
        """The earliest live milestone on the work clock (dropping stale entries)."""
        heap = self._milestones
        while heap:
            at, _, job = heap[0]
            if job.finished is None and job in self.running and at == job.mark + job._milestone():
                return at, job
            heapq.heappop(heap)
        return None

    def pop_milestone(self) -> None:
        heapq.heappop(self._milestones)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting[0]) + len(self.waiting[1])

    @property
    def kv_usage(self) -> float:
        return len(self.running) / self.slots


@dataclass
class Counters:
    """Cumulative per-class figures, exported as counters."""

    slot_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Slot-seconds of completed runs only: work lost to a preemption does not count.
    completed_slot_seconds: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float)
    )
    completed: Counter[str] = field(default_factory=Counter)
    shed: Counter[str] = field(default_factory=Counter)
    preempted: Counter[str] = field(default_factory=Counter)


class Pool:
    """Pods behind a least-loaded router; advance it to ``now`` before reading or submitting."""

    def __init__(self, config: PoolConfig, now: float = 0.0) -> None:
        self.config = config
        self.pods = [Pod(f"sim-{i}", config.max_num_seqs) for i in range(config.pods)]
        self.counters = Counters()
        self.now = now

    # -- reading ----------------------------------------------------------------------

    def running(self, cls: str | None = None) -> int:
        return sum(len(p.running) if cls is None else p.by_class[cls] for p in self.pods)

    def waiting(self) -> int:
        return sum(p.num_waiting for p in self.pods)

    def free_slots(self) -> int:
        return sum(p.slots - len(p.running) for p in self.pods)

    def running_age(self, cls: str) -> float:
        """Slot-seconds the running ``cls`` jobs have spent in their current run so far:
        what ``completed_slot_seconds`` will count for them before ``now``."""
        return sum(self.now - j.started for p in self.pods for j in p.running if j.cls == cls)

    def _pod_saturation(self, pod: Pod) -> float:
        c = self.config
        return max(pod.num_waiting / c.shed_queue_depth, pod.kv_usage / c.shed_kv_usage)

    def saturated(self) -> bool:
        return all(self._pod_saturation(p) >= 1.0 for p in self.pods)

    def saturation(self) -> float:
        """0..1: the pods' mean distance to the shedding threshold (1 = shedding)."""
        total = sum(min(1.0, self._pod_saturation(p)) for p in self.pods)
        return total / len(self.pods)

    def factor(self, pod: Pod) -> float:
        n, f = len(pod.running), self.config.time_factor_under_load
        if n <= 1 or pod.slots <= 1:
            return 1.0
        return 1.0 + (f - 1.0) * (n - 1) / (pod.slots - 1)

    # -- time -------------------------------------------------------------------------

    def next_event(self) -> float | None:
        """When the next first token or completion happens at the current load, if any."""
        soonest: float | None = None
        for pod in self.pods:
            if (milestone := pod.next_milestone()) is None:
                continue
            at = self.now + max(0.0, milestone[0] - pod.work) * self.factor(pod)
            soonest = at if soonest is None else min(soonest, at)
        return soonest

    def advance(self, now: float) -> list[Job]:
        """Run the pool up to ``now``; returns the jobs that finished on the way, in order."""
        finished: list[Job] = []
        while (at := self.next_event()) is not None and at <= now:
            self._progress(at)
            finished.extend(self._milestones())
        self._progress(max(now, self.now))
        return finished

    def _progress(self, to: float) -> None:
        dt = to - self.now
        if dt > 0:
            for pod in self.pods:
                pod.work += dt / self.factor(pod)
                for cls, n in pod.by_class.items():
                    self.counters.slot_seconds[cls] += n * dt
        self.now = max(self.now, to)

    def _milestones(self) -> list[Job]:
        finished: list[Job] = []
        for pod in self.pods:
            while (milestone := pod.next_milestone()) and milestone[0] <= pod.work + EPSILON:
                job = milestone[1]
                pod.pop_milestone()
                if job.first_token is None:
                    job.first_token = self.now
                    if job.decode > EPSILON:
                        pod.push(job)  # the next milestone: the last token
                        continue
                pod.stop(job)
                self._finish(job)
                finished.append(job)
            self._schedule(pod)
        return finished

    def _finish(self, job: Job) -> None:
        job.finished = self.now
        self.counters.completed[job.cls] += 1
        self.counters.completed_slot_seconds[job.cls] += self.now - job.started

    # -- admission --------------------------------------------------------------------

    def submit(self, job: Job, *, shed_exempt: bool = False) -> bool:
        """Route ``job`` (arrived at ``self.now``); False when the router sheds it."""
        if job.cls == BATCH and not shed_exempt and self.saturated():
            self.counters.shed[job.cls] += 1
            return False
        pod = min(self.pods, key=lambda p: len(p.running) + p.num_waiting)
        pod.waiting[self._rank(job)].append(job)
        self._schedule(pod)
        return True

    def cancel(self, job: Job) -> None:
        """The client went away: its job leaves the pool, its slot goes to the next one."""
        for pod in self.pods:
            if job in pod.running:
                pod.stop(job)
            for queue in pod.waiting:
                if job in queue:
                    queue.remove(job)
            self._schedule(pod)

    def _rank(self, job: Job) -> int:
        return 1 if self.config.scheduling_policy == "priority" and job.cls == BATCH else 0

    def _schedule(self, pod: Pod) -> None:
        """Start waiting jobs in rank order while slots are free; preempt for interactive."""
        while pod.num_waiting:
            queue = pod.waiting[0] or pod.waiting[1]
            if len(pod.running) >= pod.slots and not self._preempt_for(pod, queue[0]):
                return
            job = queue.popleft()
            job.started = self.now
            pod.start(job)

    def _preempt_for(self, pod: Pod, job: Job) -> bool:
        c = self.config
        if not (c.preemption and c.scheduling_policy == "priority" and job.cls == INTERACTIVE):
            return False
        victims = [j for j in pod.running if j.cls == BATCH]
        if not victims:
            return False
        victim = max(victims, key=lambda j: (j.arrived, j.started))  # vLLM: latest arrival
        pod.stop(victim)
        victim.preemptions += 1
        self.counters.preempted[victim.cls] += 1
        pod.waiting[self._rank(victim)].appendleft(victim)  # vLLM re-queues it at the front
        return True
