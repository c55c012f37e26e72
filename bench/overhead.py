"""(b) Overhead against a minimal loop: zero-latency gateway, 256 workers.

The daemon (``python -m async_processor run``) and ``bench.baseline`` (ZPOPMIN -> POST ->
LPUSH and nothing else, same libraries) each drain their own queue of the same messages
from the same Redis and simulator, one after the other in the same run. Printed: msg/s
and consumer CPU ms per message for both, and the daemon's cost relative to the
baseline. Run alone: ``python -m bench.overhead [--quick]``.
"""

from __future__ import annotations

from contextlib import ExitStack

from bench.common import messages_workers_main, mib, redis, simulator, verdict
from bench.harness import Run, drain

TARGET_CPU_MS = 0.25  # issue 13: daemon CPU per message, zero-latency gateway, 256 workers
TARGET_RATIO = 1.0  # and at least the baseline's throughput in the same run


async def measure(messages: int, workers: int) -> list[tuple[str, str]]:
    with ExitStack() as stack:
        url, sim = redis(stack).url, simulator(stack)
        daemon, seen = await drain(url, sim, "overhead-daemon", workers, messages)
        base, _ = await drain(url, sim, "overhead-baseline", workers, messages, baseline=True)
    ratio, cpu = daemon.rate / base.rate, daemon.cpu_ms
    return [
        ("setup", f"{messages} messages each, {workers} workers, zero-latency gateway"),
        ("daemon", describe(daemon)),
        ("baseline", describe(base)),
        ("daemon CPU per message", verdict(f"{cpu:.3f} ms", cpu <= TARGET_CPU_MS,
                                           f"≤ {TARGET_CPU_MS} ms")),
        ("daemon / baseline", verdict(f"throughput × {ratio:.2f}", ratio >= TARGET_RATIO,
                                      f"≥ {TARGET_RATIO}×") +
                              f", CPU per message × {cpu / base.cpu_ms:.2f}"),
        ("daemon's gateway calls", f"{seen['total']}, {seen['by_status']}"),
    ]  # fmt: skip


def describe(run: Run) -> str:
    return (f"{run.rate:,.0f} msg/s, {run.cpu_ms:.3f} CPU ms/msg ({run.core_share:.2f} of a core), "
            f"peak RSS {mib(run.peak_rss)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return messages_workers_main(
        "python -m bench.overhead", "(b) overhead vs a minimal loop", measure, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
