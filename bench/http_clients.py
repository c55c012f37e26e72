"""The HTTP client lever (issue 13): the daemon on each ``--http-client``, and the baseline.

Three settings, each the one of an issue-13 target, each run ``--runs`` times; in a run the
daemon on each client (``--clients``, default all) and ``bench.baseline`` drain the same
number of messages one after the other, on the same Redis and simulator. Printed: every
run, then the range over the runs of each figure with its target (pass/FALL-SHORT), and
each client's CPU per message against aiohttp's in the same run (the default changes only
at ≥ 25 % less). Not part of ``make bench`` (about 3-8 minutes a setting):
``python -m bench.http_clients overhead|littles_law|in_flight [--runs 3] [--quick]
[--clients aiohttp,httptools]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import anyio

from async_processor.httpclients import HTTP_CLIENTS
from bench import in_flight, littles_law, overhead
from bench.common import redis, simulator, table, verdict
from bench.harness import Run, drain
from bench.overhead import describe

DEFAULT_AT = 0.75  # another client becomes the default only at ≤ 0.75 of aiohttp's CPU/message


@dataclass(frozen=True)
class Setting:
    workers: int
    latency: float
    messages: int
    prompt_bytes: int
    # (label, value of a run, target check, target text)
    figure: tuple[str, Callable[[Run], float], Callable[[float], bool], str]


def _efficiency(workers: int, latency: float) -> Callable[[Run], float]:
    return lambda run: run.rate / (workers / latency)


SETTINGS = {
    "overhead": Setting(256, 0.0, 20_000, 64, ("CPU ms per message", lambda r: r.cpu_ms,
                        lambda v: v <= overhead.TARGET_CPU_MS, f"≤ {overhead.TARGET_CPU_MS}")),
    "littles_law": Setting(1024, 1.0, 20_000, 64, ("efficiency", _efficiency(1024, 1.0),
                           lambda v: v >= littles_law.TARGET, f"≥ {littles_law.TARGET}")),
    "in_flight": Setting(10_000, 10.0, 30_000, in_flight.PROMPT_BYTES,
                         ("peak RSS MB", lambda r: r.peak_rss / 1e6,
                          lambda v: v <= in_flight.TARGET_PEAK / 1e6,
                          f"≤ {in_flight.TARGET_PEAK // 10**6}")),
}  # fmt: skip


async def measure(
    name: str, runs: int, scale: float, clients: tuple[str, ...]
) -> list[tuple[str, str]]:
    s = SETTINGS[name]
    messages = int(s.messages * scale)
    label, value, ok, target = s.figure
    rows = [("setup", f"{messages} messages, {s.workers} workers, gateway latency {s.latency:g} s,"
                      f" {s.prompt_bytes} B prompts, {runs} run(s) of {', '.join(clients)}, "
                      "baseline")]  # fmt: skip
    figures: dict[str, list[float]] = {c: [] for c in (*clients, "baseline")}
    cpu: dict[str, list[float]] = {c: [] for c in figures}
    with ExitStack() as stack:
        args = ("--latency", str(s.latency)) if s.latency else ()
        url, sim = redis(stack).url, simulator(stack, *args)
        for n in range(1, runs + 1):
            for client in (*clients, "baseline"):
                run, _ = await drain(
                    url, sim, f"{name}-{client}", s.workers, messages,
                    baseline=client == "baseline", prompt_bytes=s.prompt_bytes,
                    flags=("--http-client", client),
                )  # fmt: skip
                figures[client].append(value(run))
                cpu[client].append(run.cpu_ms)
                rows.append((f"run {n} {client}", f"{describe(run)}; {label} {value(run):.3f}"))
    for client, values in figures.items():
        text = f"{min(values):.3f}–{max(values):.3f} over {len(values)} run(s)"
        rows.append((f"{label}, {client}", verdict(text, all(map(ok, values)), target)))
    for client in clients if "aiohttp" in clients else ():
        if client != "aiohttp":
            ratios = [c / a for c, a in zip(cpu[client], cpu["aiohttp"], strict=True)]
            text = f"× {min(ratios):.2f}–{max(ratios):.2f}"
            ok_ratio = max(ratios) <= DEFAULT_AT
            target = f"≤ × {DEFAULT_AT} to be the default"
            rows.append((f"{client} / aiohttp CPU per message", verdict(text, ok_ratio, target)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_clients")
    p.add_argument("setting", choices=sorted(SETTINGS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a quarter of the messages")
    p.add_argument("--clients", default=",".join(HTTP_CLIENTS), help="comma-separated")
    args = p.parse_args(argv)
    scale = 0.25 if args.quick else 1.0
    clients = tuple(args.clients.split(","))
    if unknown := set(clients) - set(HTTP_CLIENTS):
        p.error(f"unknown client(s): {', '.join(sorted(unknown))}")
    rows = anyio.run(measure, args.setting, args.runs, scale, clients)
    table(f"HTTP client: {args.setting}", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
