"""`make bench`: every figure of issue 11 in one table, each beside a floor measured in the same run.

    .venv/bin/python bench/run.py [--only drain,trigger,...] [--skip history,...] [--quick] [--json .data/bench.json]
    .venv/bin/python bench/run.py --from-json .data/bench.json [--markdown | --docs]

Starts ONE embedded Valkey and PostgreSQL for the whole run (or uses REDIS_URL / DATABASE_URL; the
measurements flush that Redis database and truncate the job tables, so never point it at data you
keep), then runs each measurement as a subprocess of its own script, one after the other. Each
script prints one JSON object of figures as its last line of stdout; its stderr goes to
`.data/bench-logs/<name>.log`. A measurement that crashes or times out gets `error: ...` in its
rows and the run goes on.

The table: figure | value | target | floor (what it is, its value in this run) | ratio (value /
floor) | result (pass / MISS against the issue's target; blank without one). Noise between runs and
machines is in both the figure and its floor, so the ratio is the figure to compare across runs.
The JSON (rows, every raw figure, the machine) goes to `--json`; `--from-json FILE --docs` puts
its table (Markdown) and machine line into docs/performance.md, after DOCS_MARKER: the one place
the table appears.

Exit status: 1 if a measurement crashed or timed out (a missed target is not an error), else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


@dataclass(frozen=True)
class Measurement:
    """One script run: `argv` after the interpreter, its full-size and `--quick` arguments."""

    name: str
    script: str
    args: tuple[str, ...]
    quick: tuple[str, ...]
    timeout: float
    what: str


MEASUREMENTS = (
    Measurement(
        "drain",
        "drain_bench.py",
        ("--runs", "50000"),
        ("--runs", "2000"),
        420,
        "50,000 test.echo runs drained by one worker (concurrency 200), full history; "
        "floors: raw Lua dequeue and raw UPDATE FROM unnest, just before",
    ),
    Measurement(
        "drain-traced",
        "drain_bench.py",
        ("--runs", "50000", "--tracing"),
        ("--runs", "2000", "--tracing"),
        420,
        "the same drain with OpenTelemetry on in the worker (every run with a trace, spans exported over "
        "OTLP/gRPC to a sink in the bench process)",
    ),
    # Issue 25: BullMQ (installed by the bench from the npm registry) on the same Valkey, alternated.
    Measurement(
        "bullmq",
        "bullmq_bench.py",
        ("--runs", "20000", "--rounds", "3"),
        ("--runs", "2000", "--rounds", "1"),
        600,
        "20,000 no-op runs drained by one worker process of 200 slots, ours (test.echo, full PostgreSQL "
        "history) then BullMQ's (a no-op Worker in Node.js, completed jobs kept in Valkey), three times "
        "alternated on the same Valkey; the median of each",
    ),
    # Issue 23: one remote Python SDK worker through one server process, beside the in-process drain.
    Measurement(
        "remote",
        "remote_bench.py",
        ("--runs", "20000", "--rounds", "3"),
        ("--runs", "2000"),
        420,
        "20,000 runs of a no-op remote handler drained by one Python SDK worker process (200 slots) through "
        "one server process, full history; floor: 20,000 test.echo runs drained by one in-process worker "
        "(concurrency 200) in the same run; in-process then remote, three times, the best of each",
    ),
    Measurement(
        "grpc-floor",
        "floors.py",
        ("grpc", "--callers", "50", "--seconds", "5"),
        ("grpc", "--callers", "50", "--seconds", "1"),
        120,
        "no-op unary grpc.aio RPC (own process), 50 concurrent callers on one channel",
    ),
    Measurement(
        "trigger",
        "api_load_bench.py",
        ("--method", "TriggerJob", "--callers", "50", "--seconds", "10", "--json"),
        ("--method", "TriggerJob", "--callers", "50", "--seconds", "2", "--json"),
        180,
        "TriggerJob from 50 concurrent callers on one channel, one server process",
    ),
    Measurement(
        "bulk-trigger",
        "api_load_bench.py",
        ("--method", "BatchTriggerJobs", "--callers", "10", "--items", "1000", "--seconds", "10", "--json"),
        ("--method", "BatchTriggerJobs", "--callers", "10", "--items", "1000", "--seconds", "2", "--json"),
        180,
        "BatchTriggerJobs of 1,000 items (a request id each) from 10 concurrent callers, one server process; "
        "runs counted in PostgreSQL; floor: the raw INSERT of the same rows, 10 connections, just before",
    ),
    Measurement(
        "timer-floor",
        "floors.py",
        ("timer", "--timers", "1000", "--seconds", "10"),
        ("timer", "--timers", "1000", "--seconds", "2"),
        60,
        "1,000 uvloop timers due at each whole second for 10 s",
    ),
    # lateness_bench.py has a mode per figure; `lateness_figures` flattens the three into the
    # "lateness" figures the rows read.
    Measurement(
        "lateness",
        "lateness_bench.py",
        ("--jobs", "1000", "--seconds", "60"),
        ("--jobs", "50", "--seconds", "5"),
        300,
        "1,000 per-second cron jobs for 60 s (2 schedulers, 2 workers: the default topology)",
    ),
    Measurement(
        "burst",
        "lateness_bench.py",
        ("--burst", "10000"),
        ("--burst", "500"),
        300,
        "10,000 one-shot jobs due in the same second (2 schedulers, 2 workers)",
    ),
    # The same two with 200 slots per worker (the drain's concurrency): the default 10 slots bound
    # how many runs a worker starts per claim round trip, so they show the claim path's own speed.
    Measurement(
        "lateness-200",
        "lateness_bench.py",
        ("--jobs", "1000", "--seconds", "60", "--set", "SCHEDULER_WORKER_CONCURRENCY=200"),
        ("--jobs", "50", "--seconds", "5", "--set", "SCHEDULER_WORKER_CONCURRENCY=200"),
        300,
        "the same 1,000 per-second cron jobs with 200 slots per worker (SCHEDULER_WORKER_CONCURRENCY=200)",
    ),
    # Issue 25's topology: what `make run` starts (a server, 2 schedulers, 3 workers of 10 slots),
    # started by `scheduler-grpc up` itself.
    Measurement(
        "lateness-shipped",
        "lateness_bench.py",
        ("--jobs", "1000", "--seconds", "60", "--shipped", "--workers", "3"),
        ("--jobs", "50", "--seconds", "5", "--shipped", "--workers", "3"),
        300,
        "the same 1,000 per-second cron jobs on `make run`'s topology (`scheduler-grpc up`: a server, "
        "2 schedulers, 3 workers of 10 slots)",
    ),
    # Issue 24: the same on a 3-master Valkey Cluster (3 replicas) with the queue in 3 shards.
    Measurement(
        "lateness-cluster",
        "lateness_bench.py",
        ("--jobs", "1000", "--seconds", "60", "--cluster", "--shards", "3"),
        ("--jobs", "50", "--seconds", "5", "--cluster", "--shards", "3"),
        300,
        "the same 1,000 per-second cron jobs (2 schedulers, 2 workers) on a 3-master, 3-replica Valkey Cluster "
        "with the queue in 3 shards",
    ),
    Measurement(
        "burst-200",
        "lateness_bench.py",
        ("--burst", "10000", "--set", "SCHEDULER_WORKER_CONCURRENCY=200"),
        ("--burst", "500", "--set", "SCHEDULER_WORKER_CONCURRENCY=200"),
        300,
        "the same 10,000 same-second jobs with 200 slots per worker",
    ),
    Measurement(
        "scan-tick",
        "lateness_bench.py",
        ("--scan-tick", "--definitions", "1000", "1000000"),
        ("--scan-tick", "--definitions", "1000", "20000"),
        600,
        "the leader's whole scan (in-process leader) over 1,000 and 1,000,000 definitions, 100 due",
    ),
    Measurement(
        "failover",
        "failover_bench.py",
        ("--kills", "10", "--stops", "10"),
        ("--kills", "1", "--stops", "1"),
        900,
        "2 schedulers + 1 worker, default leader TTL, 5 per-second jobs; kill -9 x10, SIGTERM x10",
    ),
    Measurement(
        "watch",
        "watch_bench.py",
        ("--subscribers", "1000", "--runs", "200"),
        ("--subscribers", "100", "--runs", "50"),
        420,
        "1,000 WatchExecutions streams (SUCCEEDED of one job) while one worker drains 200 runs "
        "of it: every subscriber gets every event",
    ),
    # Issue 22 (bench/limits_bench.py): limits enforced end to end.
    Measurement(
        "limits-rate",
        "limits_bench.py",
        ("rate", "--runs", "5000"),
        ("rate", "--runs", "500"),
        300,
        "a rate limit of 100/s, burst 10, on one key: a backlog of 5,000 test.echo runs, one worker "
        "(200 slots); floor: the same backlog without the limit",
    ),
    Measurement(
        "limits-noisy",
        "limits_bench.py",
        ("noisy", "--noisy-runs", "100000", "--seconds", "30"),
        ("noisy", "--noisy-runs", "2000", "--quiet", "20", "--seconds", "5"),
        600,
        "100 per-second cron jobs, each its own key of a concurrency limit of 1, for 30 s alone, then 30 s "
        "beside one key with 100,000 queued runs (2 schedulers, 2 workers)",
    ),
    Measurement(
        "limits-overhead",
        "limits_bench.py",
        ("overhead", "--runs", "20000", "--rounds", "5"),
        ("overhead", "--runs", "2000", "--rounds", "1"),
        900,
        "20,000 test.echo runs drained by one worker (200 slots), without limits and with one limit that "
        "never blocks, alternated five times; the median of each, in executions/s and in CPU per execution "
        "(worker, Valkey and PostgreSQL together)",
    ),
    # Issue 24: the drain on a 3-master Valkey Cluster with a 3-shard queue beside one server.
    Measurement(
        "cluster",
        "cluster_bench.py",
        ("--runs", "50000", "--rounds", "3"),
        ("--runs", "2000", "--rounds", "1", "--idle", "2"),
        1800,
        "50,000 test.echo runs drained on one Valkey (unsharded queue) and on a 3-master, 3-replica Valkey Cluster "
        "(3-shard queue), by 1 and by 3 workers of 200 slots; the four alternated three times, the median of each; "
        "every sharded drain checked exactly-once in PostgreSQL",
    ),
    # Issue 24: the worker's hot path and retention on a 100,000,000-row history, beside 1,000,000 rows.
    Measurement(
        "history",
        "history_bench.py",
        ("--history", "100000000", "--floor", "1000000", "--rounds", "11"),
        ("--history", "200000", "--floor", "50000", "--days", "4", "--runs", "400", "--batch", "100", "--rounds", "1"),
        7200,
        "100,000,000 finished attempts over 30 days (3.3M a day) generated straight into day partitions, beside "
        "1,000,000 in a database of their own; claim and completion batches of 200 through RunRepository on each, "
        "alternated eleven times; retention of the oldest day, and of one holding an open run (kept)",
    ),
    Measurement(
        "idle",
        "idle_bench.py",
        ("--seconds", "60"),
        ("--seconds", "5"),
        180,
        "one scheduler (leading) and one worker, no jobs, 60 s",
    ),
)


def _get(results: dict[str, Any], name: str, key: str) -> float | None:
    value = results.get(name, {}).get("figures", {}).get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


Floor = Callable[[dict[str, Any]], float | None]


def floor_of(name: str, key: str) -> Floor:
    return lambda results: _get(results, name, key)


def lateness_figures(results: dict[str, Any]) -> None:
    """Merge the figures of lateness_bench.py's three modes into `results["lateness"]` (flat keys).

    Steady mode: start lateness (worker start - slot) p50/p99/max, with the slots not started by
    the end; burst mode: time until all started; scan-tick mode: the median scan per table size.
    """
    flat: dict[str, Any] = {}
    errors: list[str] = []
    for name in ("lateness", "burst", "scan-tick", "lateness-200", "burst-200", "lateness-shipped", "lateness-cluster"):
        result = results.get(name)
        if result is None:
            continue
        if result.get("error"):
            errors.append(f"{name}: {result['error']}")
        raw = result.get("figures", {})
        suffix = {"-200": "_200", "-shipped": "_shipped", "-cluster": "_cluster"}.get(name[name.rfind("-") :], "")
        if suffix and raw.get("mode") in ("steady", "burst"):
            figures: dict[str, Any] = {}
            _flatten(raw, figures)
            flat |= {f"{key}{suffix}": value for key, value in figures.items()}
        elif "lateness_p99_ms" in raw or "scan_tick_1k_ms" in raw or "burst_all_started_s" in raw:
            flat |= raw  # already flat (a saved report)
        elif raw.get("mode") in ("steady", "burst"):
            _flatten(raw, flat)
        elif raw.get("mode") == "scan_tick":
            scans = raw.get("scans", {})
            sizes = sorted(scans, key=int)
            if sizes:
                flat["scan_tick_1k_ms"] = scans[sizes[0]].get("median_ms")
                flat["scan_tick_1m_ms"] = scans[sizes[-1]].get("median_ms")
            flat["pg_roundtrip_ms"] = raw.get("pg_roundtrip_ms")
    if errors:
        flat["errors"] = errors
    if flat or errors:
        results["lateness"] = {**results.get("lateness", {"error": ""}), "figures": flat}


def _flatten(raw: dict[str, Any], flat: dict[str, Any]) -> None:
    """The flat figures of one steady or burst run of lateness_bench.py."""
    if raw.get("mode") == "steady":
        start, fire = raw.get("start", {}), raw.get("fire", {})
        flat |= {
            "lateness_p50_ms": start.get("p50_ms"), "lateness_p99_ms": start.get("p99_ms"),
            "lateness_max_ms": start.get("max_ms"), "fire_p50_ms": fire.get("p50_ms"),
            "fire_p99_ms": fire.get("p99_ms"), "lateness_slots": raw.get("slots_expected"),
            "lateness_not_started": (raw.get("slots_expected") or 0) - (raw.get("slots_started") or 0),
        }  # fmt: skip
    else:
        flat |= {"burst_all_started_s": raw.get("all_started_s"), "burst_all_fired_s": raw.get("all_fired_s"),
                 "burst_not_started": (raw.get("jobs") or 0) - (raw.get("started") or 0)}  # fmt: skip


def burst_floor(results: dict[str, Any]) -> float | None:
    """10,000 runs at the drain rate measured in this run: the burst cannot all start sooner."""
    rate = _get(results, "drain", "executions_per_s")
    return 10_000 / rate if rate else None


@dataclass(frozen=True)
class Row:
    """A line of the table.

    Attributes:
        figure: What is measured.
        source: (measurement, key) of the value.
        unit: Shown after the value.
        target: ("≥"|"≤"|"<", number) on the value, or ("ratio≤"|"ratio≥", number) on the ratio; None: none.
        floor: The floor's value in this run (None: this figure has no floor).
        floor_label: What the floor is (short; the legend below the table says more).
    """

    figure: str
    source: tuple[str, str]
    unit: str
    target: tuple[str, float] | None = None
    floor: Floor | None = None
    floor_label: str = ""


ROWS = (
    Row(
        "drain: executions/s (50,000 runs, 1 worker)",
        ("drain", "executions_per_s"),
        "/s",
        ("≥", 6500),
        floor_of("drain", "lua_dequeue_items_per_s"),
        "raw Lua dequeue items/s",
    ),
    Row(
        "drain: executions/s vs PostgreSQL floor",
        ("drain", "executions_per_s"),
        "/s",
        None,
        floor_of("drain", "pg_update_rows_per_s"),
        "raw UPDATE…FROM unnest rows/s",
    ),
    Row(
        "drain: worker CPU per execution",
        ("drain", "worker_cpu_us"),
        "µs",
        ("≤", 150),
        floor_of("drain", "lua_dequeue_client_cpu_us"),
        "raw Lua dequeue, client µs/item",
    ),
    Row(
        "drain: Valkey CPU per execution",
        ("drain", "valkey_cpu_us"),
        "µs",
        None,
        floor_of("drain", "lua_dequeue_valkey_cpu_us"),
        "raw Lua dequeue, Valkey µs/item",
    ),
    Row(
        "drain: PostgreSQL CPU per execution",
        ("drain", "postgres_cpu_us"),
        "µs",
        None,
        floor_of("drain", "pg_update_cpu_us"),
        "raw UPDATE…FROM unnest, µs/row",
    ),
    Row(
        "drain, tracing on: executions/s",
        ("drain-traced", "executions_per_s"),
        "/s",
        None,
        floor_of("drain", "executions_per_s"),
        "the drain, tracing off",
    ),
    Row(
        "drain, tracing on: worker CPU per execution",
        ("drain-traced", "worker_cpu_us"),
        "µs",
        None,
        floor_of("drain", "worker_cpu_us"),
        "the drain, tracing off",
    ),
    Row(
        "drain beside BullMQ: executions/s (20,000 runs, 1 worker of 200 slots, median of 3)",
        ("bullmq", "ours_executions_per_s"),
        "/s",
        ("ratio≥", 1.05),
        floor_of("bullmq", "bullmq_executions_per_s"),
        "BullMQ, same run and Valkey",
    ),
    Row(
        "drain beside BullMQ: CPU per execution (worker, Valkey, PostgreSQL)",
        ("bullmq", "ours_cpu_us"),
        "µs",
        None,
        floor_of("bullmq", "bullmq_cpu_us"),
        "BullMQ worker + Valkey µs",
    ),
    Row(
        "remote worker drain: executions/s (20,000 runs, 1 server + 1 Python SDK worker)",
        ("remote", "remote_executions_per_s"),
        "/s",
        ("ratio≥", 0.5),
        floor_of("remote", "inprocess_executions_per_s"),
        "in-process drain, same run",
    ),
    Row(
        "remote worker drain: server CPU per execution",
        ("remote", "remote_server_cpu_us"),
        "µs",
        None,
        floor_of("remote", "inprocess_worker_cpu_us"),
        "in-process worker µs/execution",
    ),
    Row(
        "remote worker drain: SDK worker CPU per execution",
        ("remote", "remote_sdk_cpu_us"),
        "µs",
        None,
        floor_of("remote", "inprocess_worker_cpu_us"),
        "in-process worker µs/execution",
    ),
    Row(
        "TriggerJob RPCs/s (50 clients)",
        ("trigger", "rpcs_per_s"),
        "/s",
        ("ratio≥", 0.5),  # issue 25: half the no-op call of the same run (issue 11's 3,000/s was absolute)
        floor_of("grpc-floor", "grpc_noop_rpcs_per_s"),
        "no-op gRPC RPCs/s",
    ),
    Row(
        "TriggerJob p50",
        ("trigger", "p50_ms"),
        "ms",
        None,
        floor_of("grpc-floor", "grpc_noop_p50_ms"),
        "no-op gRPC p50",
    ),
    Row(
        "TriggerJob p99",
        ("trigger", "p99_ms"),
        "ms",
        None,
        floor_of("grpc-floor", "grpc_noop_p99_ms"),
        "no-op gRPC p99",
    ),
    Row(
        "BatchTriggerJobs: runs recorded/s (10 callers, 1,000 items per call)",
        ("bulk-trigger", "runs_per_s"),
        "/s",
        ("≥", 20000),
        floor_of("bulk-trigger", "raw_insert_rows_per_s"),
        "raw INSERT…SELECT FROM unnest rows/s",
    ),
    Row(
        "BatchTriggerJobs: server CPU per run",
        ("bulk-trigger", "server_cpu_us_per_run"),
        "µs",
        None,
    ),
    Row(
        "BatchTriggerJobs: PostgreSQL CPU per run",
        ("bulk-trigger", "postgres_cpu_us_per_run"),
        "µs",
        None,
    ),
    Row(
        "lateness p50 (1,000 per-second cron, 60 s)",
        ("lateness", "lateness_p50_ms"),
        "ms",
        None,
        floor_of("timer-floor", "timer_p50_ms"),
        "1,000 timers/s p50",
    ),
    Row(
        "lateness p99",
        ("lateness", "lateness_p99_ms"),
        "ms",
        ("<", 50),
        floor_of("timer-floor", "timer_p99_ms"),
        "1,000 timers/s p99",
    ),
    Row(
        "lateness max",
        ("lateness", "lateness_max_ms"),
        "ms",
        None,
        floor_of("timer-floor", "timer_max_ms"),
        "1,000 timers/s max",
    ),
    Row(
        "10,000 jobs due in one second: all started",
        ("lateness", "burst_all_started_s"),
        "s",
        ("≤", 2),
        burst_floor,
        "10,000 ÷ drain rate",
    ),
    Row(
        "lateness p50, 200 slots per worker",
        ("lateness", "lateness_p50_ms_200"),
        "ms",
        None,
        floor_of("timer-floor", "timer_p50_ms"),
        "1,000 timers/s p50",
    ),
    Row(
        "lateness p99, 200 slots per worker",
        ("lateness", "lateness_p99_ms_200"),
        "ms",
        ("<", 50),
        floor_of("timer-floor", "timer_p99_ms"),
        "1,000 timers/s p99",
    ),
    Row(
        "10,000 jobs due in one second, 200 slots per worker: all started",
        ("lateness", "burst_all_started_s_200"),
        "s",
        ("≤", 2),
        burst_floor,
        "10,000 ÷ drain rate",
    ),
    Row(
        "lateness p50, `make run`'s topology (server, 2 schedulers, 3 workers of 10 slots)",
        ("lateness", "lateness_p50_ms_shipped"),
        "ms",
        None,
        floor_of("timer-floor", "timer_p50_ms"),
        "1,000 timers/s p50",
    ),
    Row(
        "lateness p99, `make run`'s topology",
        ("lateness", "lateness_p99_ms_shipped"),
        "ms",
        ("<", 50),
        floor_of("timer-floor", "timer_p99_ms"),
        "1,000 timers/s p99",
    ),
    Row(
        "lateness p99 on the Valkey Cluster (3-shard queue, 1,000 per-second cron)",
        ("lateness", "lateness_p99_ms_cluster"),
        "ms",
        ("<", 50),
        floor_of("lateness", "lateness_p99_ms"),
        "the same on one Valkey",
    ),
    Row(
        "scan tick, 1,000 definitions (100 due)",
        ("lateness", "scan_tick_1k_ms"),
        "ms",
        None,
        floor_of("lateness", "pg_roundtrip_ms"),
        "SELECT now() round trip",
    ),
    Row(
        "scan tick, 1,000,000 definitions (100 due)",
        ("lateness", "scan_tick_1m_ms"),
        "ms",
        ("ratio≤", 2),
        floor_of("lateness", "scan_tick_1k_ms"),
        "the 1,000-definition tick",
    ),
    Row("failover kill -9: next slot fired p50", ("failover", "kill9_p50_s"), "s"),
    Row("failover kill -9: next slot fired p99", ("failover", "kill9_p99_s"), "s"),
    Row("failover SIGTERM: next slot fired p50", ("failover", "sigterm_p50_s"), "s"),
    Row("failover SIGTERM: next slot fired p99", ("failover", "sigterm_p99_s"), "s"),
    Row(
        "1,000 watchers during a drain: events/s delivered",
        ("watch", "events_per_s"),
        "/s",
        None,
        floor_of("watch", "fanout_msgs_per_s"),
        "no-op gRPC fan-out msgs/s",
    ),
    Row(
        "1,000 watchers: delay p99 (event → receipt)",
        ("watch", "delay_p99_ms"),
        "ms",
        ("<", 1000),
        floor_of("watch", "fanout_delay_p99_ms"),
        "no-op gRPC fan-out p99",
    ),
    Row(
        "rate limit 100/s burst 10: most starts in a 1 s window (5,000 runs)",
        ("limits-rate", "rate_max_starts_1s"),
        "",
        ("≤", 110),
        floor_of("limits-rate", "free_max_starts_1s"),
        "the same backlog, no limit",
    ),
    Row(
        "rate limit 100/s burst 10: drain rate (≥ 95)",
        ("limits-rate", "rate_drain_per_s"),
        "/s",
        ("≥", 95),
        floor_of("limits-rate", "free_executions_per_s"),
        "the same backlog, no limit",
    ),
    Row(
        "rate limit 100/s burst 10: drain rate (≤ 105)",
        ("limits-rate", "rate_drain_per_s"),
        "/s",
        ("≤", 105),
    ),
    Row(
        "quiet cron p99 beside a key with 100,000 queued runs",
        ("limits-noisy", "quiet_p99_noisy_ms"),
        "ms",
        None,
        floor_of("limits-noisy", "quiet_p99_alone_ms"),
        "the same 100 jobs alone",
    ),
    Row(
        "quiet cron p99 rise from the noisy key",
        ("limits-noisy", "quiet_p99_rise_ms"),
        "ms",
        ("<", 50),
    ),
    Row(
        "drain with one limit: executions/s (median)",
        ("limits-overhead", "capped_executions_per_s"),
        "/s",
        ("ratio≥", 0.85),
        floor_of("limits-overhead", "free_executions_per_s"),
        "the same drain, no limit",
    ),
    Row(
        "drain with one limit: CPU per execution (median)",
        ("limits-overhead", "capped_cpu_us"),
        "µs",
        None,  # shown beside the throughput row the issue names: what the limit costs each process
        floor_of("limits-overhead", "free_cpu_us"),
        "the same drain, no limit",
    ),
    Row(
        "one Valkey, 1 worker: executions/s (50,000 runs, median of 3)",
        ("cluster", "one_executions_per_s"),
        "/s",
    ),
    Row(
        "one Valkey, 1 worker: CPU per execution (worker, Valkey, PostgreSQL)",
        ("cluster", "one_cpu_us"),
        "µs",
    ),
    Row(
        "Valkey Cluster (3 masters, 3-shard queue), 1 worker: executions/s",
        ("cluster", "cluster1_executions_per_s"),
        "/s",
        None,  # one machine: the cluster's six Valkey processes share its cores with the rest
        floor_of("cluster", "one_executions_per_s"),
        "one Valkey, 1 worker",
    ),
    Row(
        "Valkey Cluster, 1 worker: CPU per execution (worker, 6 Valkey, PostgreSQL)",
        ("cluster", "cluster1_cpu_us"),
        "µs",
        ("ratio≤", 1.5),  # 1.2x the cluster and shards, 0.3x the replicas (docs/performance.md)
        floor_of("cluster", "one_cpu_us"),
        "one Valkey, 1 worker",
    ),
    Row(
        "Valkey Cluster, 3 workers: executions/s",
        ("cluster", "cluster3_executions_per_s"),
        "/s",
        None,
        floor_of("cluster", "one_executions_per_s"),
        "one Valkey, 1 worker",
    ),
    Row(
        "one Valkey, 3 workers: CPU per execution",
        ("cluster", "one3_cpu_us"),
        "µs",
        None,  # what three workers cost against one, without the cluster
        floor_of("cluster", "one_cpu_us"),
        "one Valkey, 1 worker",
    ),
    Row(
        "Valkey Cluster, 3 workers: CPU per execution",
        ("cluster", "cluster3_cpu_us"),
        "µs",
        ("ratio≤", 1.5),  # 1.2x the cluster and shards, 0.3x the replicas (docs/performance.md)
        floor_of("cluster", "one3_cpu_us"),
        "one Valkey, 3 workers",
    ),
    Row(
        "sharded drains: runs not succeeded exactly once",
        ("cluster", "sharded_not_exactly_once"),
        "",
        ("≤", 0),
    ),
    Row(
        "history of 100,000,000 rows: claim per execution (batches of 200)",
        ("history", "claim_us"),
        "µs",
        ("ratio≤", 1.2),
        floor_of("history", "floor_claim_us"),
        "the same on 1,000,000 rows",
    ),
    Row(
        "history of 100,000,000 rows: completion per execution",
        ("history", "complete_us"),
        "µs",
        ("ratio≤", 1.2),
        floor_of("history", "floor_complete_us"),
        "the same on 1,000,000 rows",
    ),
    Row(
        "history of 100,000,000 rows: retention of a day (detach + drop, 3.3M rows)",
        ("history", "retention_day_s"),
        "s",
        ("<", 1),
        floor_of("history", "floor_retention_day_s"),
        "the same on 1,000,000 rows",
    ),
    Row("history: rows generated/s (straight into the day partitions)", ("history", "generated_rows_per_s"), "/s"),
    Row("history of 100,000,000 rows: size on disk", ("history", "database_gb"), "GB"),
    Row(
        "idle worker CPU (60 s)",
        ("idle", "worker_idle_pct"),
        "% core",
        ("<", 1),
        floor_of("idle", "floor_idle_pct"),
        "bare uvloop process, 100 ms tick",
    ),
    Row(
        "idle scheduler CPU (60 s, leading)",
        ("idle", "scheduler_idle_pct"),
        "% core",
        None,
        floor_of("idle", "floor_idle_pct"),
        "bare uvloop process, 100 ms tick",
    ),
)

LEGEND = """\
Floors (measured in the same run, on the same servers, right before or beside the figure):
  raw Lua dequeue      one Lua script: ZPOPMIN 50 from a sorted set + ZADD them to another, one caller
  raw UPDATE…FROM unnest  `UPDATE t SET status, finished_at FROM unnest($1::bigint[])`, 50 rows/statement, 4 connections
  no-op gRPC           a grpc.aio server (own process) with a no-op unary method, 50 concurrent callers, one channel
  raw INSERT…SELECT FROM unnest  the rows BatchTriggerJobs writes (a job's snapshot, a request id each and its
                       claim), 1,000 per statement from 10 connections, without its checks, events, enqueue or gRPC
  1,000 timers/s       1,000 uvloop call_at timers due at each whole second for 10 s: (ran - due)
  SELECT now() round trip  the least any statement of a scan tick costs, same pool, same moment
  10,000 ÷ drain rate  the burst cannot all start sooner than the worker can run 10,000 executions
  the drain, tracing off  the drain row above (same run): the ratio is the cost of tracing on
  BullMQ, same run     BullMQ (bench/bullmq's locked version, from npm) draining as many no-op jobs with one Worker
                       of as many slots on the same Valkey, alternated with ours; its CPU: Node worker + Valkey
  in-process drain, worker  remote rows: 20,000 test.echo runs drained by one in-process worker (concurrency 200),
                       same run, same servers (its executions/s; its CPU per execution)
  no-op gRPC fan-out   a no-op grpc.aio server pushing as many tiny messages to as many streams (same client code)
  bare uvloop process  a Python process whose loop wakes every 100 ms and does nothing
  failover             no floor: the time includes the wait for the next whole-second slot (0-1 s)
  one Valkey, N workers  cluster rows (issue 24): the same drain in the same run on the one Valkey, queue unsharded,
                       as many workers; alternated with the cluster's, the median of each
  no limit / alone     limits (issue 22): the same work in the same run without the limit, or without the noisy key
  the same on 1,000,000 rows  history (issue 24): a database of its own in the same run, 1,000,000 rows over the
                       same 30 days, its claim and completion batches alternated with the large history's
ratio = value ÷ floor (for µs, %, ms and s lower is better; for /s higher is better)."""


def _number(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _target_text(target: tuple[str, float] | None, unit: str) -> str:
    if target is None:
        return ""
    op, number = target
    if op in ("ratio≤", "ratio≥"):
        return f"{op[-1]} {number:g}× floor"  # noqa: RUF001
    return f"{op} {number:,g} {unit}"


def build_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows from the measurements' results (`{name: {"figures": {...}, "error": str}}`)."""
    rows = []
    for row in ROWS:
        name, key = row.source
        if name not in results:
            continue  # not run (--only)
        error = results.get(name, {}).get("error") or ""
        value = _get(results, name, key)
        floor = row.floor(results) if row.floor is not None else None
        ratio = value / floor if value is not None and floor else None
        result = ""
        phase_errors = results[name].get("figures", {}).get("errors")
        if error:
            result = f"error: {error}"
        elif value is None:
            result = f"error: {'; '.join(phase_errors)}" if phase_errors else "missing"
        elif row.target is not None:
            op, number = row.target
            checked = ratio if op.startswith("ratio") else value
            if checked is None:
                result = "missing floor"
            else:
                ok = {"≥": checked >= number, "≤": checked <= number, "<": checked < number,
                      "ratio≤": checked <= number, "ratio≥": checked >= number}[op]  # fmt: skip
                result = "pass" if ok else "MISS"
        rows.append({
            "figure": row.figure, "value": value, "unit": row.unit, "target": _target_text(row.target, row.unit),
            "floor_label": row.floor_label, "floor": floor, "ratio": ratio, "result": result,
        })  # fmt: skip
    return rows


def _cells(row: dict[str, Any]) -> list[str]:
    value = "—" if row["value"] is None else f"{_number(row['value'])} {row['unit']}"
    if row["floor_label"]:
        floor = f"{row['floor_label']}: " + ("—" if row["floor"] is None else _number(row["floor"]))
    else:
        floor = ""
    ratio = "" if row["ratio"] is None else f"{row['ratio']:.3g}×"  # noqa: RUF001
    return [row["figure"], value, row["target"], floor, ratio, row["result"]]


HEADER = ["figure", "value", "target", "floor (same run)", "ratio", "result"]


def render_text(rows: list[dict[str, Any]]) -> str:
    table = [HEADER, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER) - 1)]
    lines = []
    for index, line in enumerate(table):
        lines.append("  ".join(
            [cell.ljust(width) if i in (0, 2, 3) else cell.rjust(width)
             for i, (cell, width) in enumerate(zip(line[:-1], widths, strict=True))] + [line[-1]]
        ).rstrip())  # fmt: skip
        if index == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def render_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---", "---:", "---", "---", "---:", "---"]) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in _cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def notes(results: dict[str, Any]) -> list[str]:
    """What the table cannot show: sample counts, streams ended early, checker violations."""
    out = []
    figures = {name: result.get("figures", {}) for name, result in results.items()}
    if (lateness := figures.get("lateness")) and "lateness_slots" in lateness:
        out.append(f"lateness: {lateness.get('lateness_slots')} slots, {lateness.get('lateness_not_started', '?')}"
                   " of them not started by the end (counted with their lateness then, a lower bound)")  # fmt: skip
    if (lateness := figures.get("lateness")) and lateness.get("burst_not_started"):
        out.append(f"burst: {lateness['burst_not_started']} not started yet when measured (a lower bound)")
    if (lateness := figures.get("lateness")) and lateness.get("errors"):
        out.append(f"lateness errors: {'; '.join(lateness['errors'])}")

    if watch := figures.get("watch"):
        out.append(f"watchers: {watch.get('delivered')} of {watch.get('expected')} deliveries,"
                   f" streams ended early: {watch.get('ended_early') or 'none'}")  # fmt: skip
    if failover := figures.get("failover"):
        out.append(f"failover: {failover.get('kill9_rounds')} kill -9 and {failover.get('sigterm_rounds')} SIGTERM"
                   f" rounds, leader TTL {failover.get('leader_ttl_s')} s, checker violations:"
                   f" {failover.get('violations') or 'none'}")  # fmt: skip
    if bulk := figures.get("bulk-trigger"):
        out.append(f"bulk-trigger: {bulk.get('runs_recorded')} runs recorded from {bulk.get('calls')} calls "
                   f"({bulk.get('errors')} failed), call p50 {bulk.get('p50_ms')} ms, "
                   f"p99 {bulk.get('p99_ms')} ms")  # fmt: skip
    if remote := figures.get("remote"):
        rounds = remote.get("rounds") or []
        ratios = ", ".join(f"{r.get('remote_ratio', float('nan')):.2f}" for r in rounds if isinstance(r, dict))
        out.append(f"remote: {remote.get('runs')} runs per drain, {len(rounds)} round(s), remote ÷ in-process by"
                   f" round: {ratios or '—'}")  # fmt: skip
    if cluster := figures.get("cluster"):
        out.append(f"cluster: {cluster.get('runs')} runs per drain, {cluster.get('rounds')} round(s); "
                   f"{cluster.get('sharded_runs_verified')} sharded runs checked in PostgreSQL, duplicates "
                   f"{cluster.get('cluster1_duplicates', 0) + cluster.get('cluster3_duplicates', 0)}, missing "
                   f"{cluster.get('cluster1_missing', 0) + cluster.get('cluster3_missing', 0)}; shards on "
                   f"{cluster.get('cluster_shard_masters')} masters, runs per shard "
                   f"{cluster.get('cluster3_per_shard')}; idle Valkey CPU: one "
                   f"{100 * (cluster.get('one_idle_valkey_core') or 0):.1f} %, cluster "
                   f"{100 * (cluster.get('cluster_idle_valkey_core') or 0):.1f} % of a core; 3 workers on the "
                   f"cluster: each worker {100 * (cluster.get('cluster3_worker_core') or 0):.0f} %, busiest master "
                   f"{100 * (cluster.get('cluster3_busiest_master_core') or 0):.0f} %, PostgreSQL "
                   f"{100 * (cluster.get('cluster3_postgres_core') or 0):.0f} % of a core; at a whole core "
                   f"would carry: a worker process {cluster.get('cluster3_worker_ceiling_per_s') or 0:,.0f}/s, the "
                   f"busiest master {cluster.get('cluster3_busiest_master_ceiling_per_s') or 0:,.0f}/s, PostgreSQL "
                   f"{cluster.get('cluster3_postgres_ceiling_per_s') or 0:,.0f}/s per core")  # fmt: skip
    if history := figures.get("history"):
        out.append(f"history: {history.get('rows', 0):,} rows over {history.get('days')} days, generated in "
                   f"{history.get('generate_s')} s by {history.get('loaders')} connections (heap "
                   f"{history.get('heap_gb')} GB, indexes {history.get('index_gb')} GB), schema as migrated: "
                   f"{'yes' if history.get('schema_identical') else 'NO'}; claim batches by round "
                   f"{history.get('claim_batch_ms_rounds')} ms ({history.get('floor_rows', 0):,} rows: "
                   f"{history.get('floor_claim_batch_ms_rounds')}), completion "
                   f"{history.get('complete_batch_ms_rounds')} ms ({history.get('floor_complete_batch_ms_rounds')}); "
                   f"a day holding an open run kept: {'yes' if history.get('open_day_kept') else 'NO'}")  # fmt: skip
    if drain := figures.get("drain"):
        out.append(f"drain: {drain.get('runs')} runs in {drain.get('drain_seconds', float('nan')):.1f} s")
    return out


# -- running -----------------------------------------------------------------------------------------


def parse_output(stdout: str) -> dict[str, Any]:
    """The figures a script printed: its last stdout line that is a JSON object.

    api_load_bench.py --method TriggerJob prints text; its figures are read from that text unless it
    prints a JSON line (keys rpcs_per_s, p50_ms, p99_ms).
    """
    import re

    for raw in reversed(stdout.strip().splitlines()):
        line = raw.strip()
        if line.startswith("{"):
            try:
                parsed = json.loads(line)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                if "rps" in parsed and "rpcs_per_s" not in parsed:  # api_load_bench.py --json
                    parsed["rpcs_per_s"] = parsed["rps"]
                return parsed
    found = re.search(r"([\d,.]+) RPCs/s, p50 ([\d.]+) ms, p99 ([\d.]+) ms", stdout)
    if found:
        figures: dict[str, Any] = {
            "rpcs_per_s": float(found[1].replace(",", "")), "p50_ms": float(found[2]), "p99_ms": float(found[3]),
        }  # fmt: skip
        if cpu := re.search(r"server CPU (\d+) us per call", stdout):
            figures["server_cpu_us"] = float(cpu[1])
        return figures
    raise ValueError("no JSON line of figures in its output")


def run_one(measurement: Measurement, quick: bool, env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    argv = [sys.executable, str(BENCH / measurement.script), *(measurement.quick if quick else measurement.args)]
    log_path = log_dir / f"{measurement.name}.log"
    began = time.monotonic()
    result: dict[str, Any] = {"argv": argv[1:], "figures": {}, "error": ""}
    with open(log_path, "wb") as log:
        # A session of its own: on a timeout the whole tree it started (roles, servers) is ended.
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, cwd=ROOT,
                                   start_new_session=True)  # fmt: skip
        try:
            stdout, _ = process.communicate(timeout=measurement.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                stdout, _ = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, _ = process.communicate()
            result["error"] = f"timed out after {measurement.timeout:g}s (log: {log_path})"
    text = stdout.decode(errors="replace")
    result["seconds"] = time.monotonic() - began
    if not result["error"]:
        try:
            result["figures"] = parse_output(text)
            if process.returncode != 0:
                result["exit"] = process.returncode  # figures printed, then a non-zero exit: keep both
        except ValueError:
            tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
            result["error"] = f"exit {process.returncode}: {tail[0][-160:] if tail else 'no output'} (log: {log_path})"
    return result


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
        "kernel": platform.release(), "load_average_at_start": os.getloadavg(),
    }  # fmt: skip


DOCS_PAGE = ROOT / "docs" / "performance.md"
DOCS_MARKER = "<!-- bench table: generated by bench/run.py --from-json .data/bench.json --docs -->\n"


def docs_block(report: dict[str, Any]) -> str:
    """The Markdown table and the machine line, as docs/performance.md shows them."""
    m = report.get("machine", {})
    load = ", ".join(f"{x:.2f}" for x in m.get("load_average_at_start", []))
    return (
        render_markdown(report["rows"])
        + f"\n\n{m.get('cpus')} CPUs ({m.get('cpu_model')}), Python {m.get('python')}, load average {load} at the"
        + f" start; `make bench` took {report.get('wall_s', 0) / 60:.1f} min ({report.get('started', '')[:10]})."
        + "".join(f" {note[0].upper()}{note[1:]}." for note in report.get("notes", []))
    )


def update_docs(report: dict[str, Any], page: Path = DOCS_PAGE) -> None:
    """Replace what follows DOCS_MARKER, up to the next blank line after the machine line."""
    text = page.read_text()
    start = text.index(DOCS_MARKER) + len(DOCS_MARKER)
    end = text.index("\n\n", text.index("\n\n", start) + 2)
    page.write_text(text[:start] + docs_block(report) + text[end:])


def print_report(report: dict[str, Any], *, markdown: bool = False) -> None:
    rows = report["rows"]
    print(render_markdown(rows) if markdown else render_text(rows))
    print()
    for line in report.get("notes", []):
        print(line)
    m = report.get("machine", {})
    print(f"machine: {m.get('cpus')} CPUs ({m.get('cpu_model')}), Python {m.get('python')}, load average at start "
          f"{', '.join(f'{x:.2f}' for x in m.get('load_average_at_start', []))}; wall time "
          f"{report.get('wall_s', 0):.0f} s")  # fmt: skip
    if not markdown:
        print()
        print(LEGEND)


def load_report(path: Path) -> dict[str, Any]:
    """A saved report, its rows built again from its raw figures (so the rows follow this file's ROWS)."""
    report: dict[str, Any] = json.loads(path.read_text())
    if "measurements" in report:
        report["rows"] = build_rows(report["measurements"])
        report["notes"] = notes(report["measurements"])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated measurements: " + ",".join(m.name for m in MEASUREMENTS))
    parser.add_argument("--skip", help="comma-separated measurements not to run (e.g. history: ~30 of the ~55 min)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run of the harness, ~2 min)")
    parser.add_argument("--json", default=str(ROOT / ".data" / "bench.json"), help="where the JSON report goes")
    parser.add_argument("--from-json", help="print the table of a saved report instead of measuring")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--docs", action="store_true", help="with --from-json: put the table into docs/performance.md")
    args = parser.parse_args()
    if args.from_json:
        saved = load_report(Path(args.from_json))
        if args.docs:
            update_docs(saved)
        else:
            print_report(saved, markdown=args.markdown)
        return 0
    only = set(args.only.split(",")) if args.only else set()
    skip = set(args.skip.split(",")) if args.skip else set()
    if unknown := (only | skip) - {m.name for m in MEASUREMENTS}:
        parser.error(f"unknown measurement(s): {', '.join(sorted(unknown))}")
    chosen = [m for m in MEASUREMENTS if (not only or m.name in only) and m.name not in skip]
    if not chosen:
        parser.error("--only and --skip leave no measurement to run")  # and the saved report untouched
    sys.path.insert(0, str(ROOT))
    from scheduler_grpc.embedded import embedded_servers

    data = ROOT / ".data"
    log_dir = data / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"started": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
                              "quick": args.quick}  # fmt: skip
    results: dict[str, Any] = {}
    began = time.monotonic()
    with embedded_servers(data, redis_url=os.environ.get("REDIS_URL") or None,
                          database_url=os.environ.get("DATABASE_URL") or None, throwaway=True) as urls:  # fmt: skip
        env = {**os.environ, "REDIS_URL": urls.redis_url, "DATABASE_URL": urls.database_url}
        for index, measurement in enumerate(chosen, 1):
            print(f"[{index}/{len(chosen)}] {measurement.name}: {measurement.what} ...", file=sys.stderr, flush=True)
            results[measurement.name] = result = run_one(measurement, args.quick, env, log_dir)
            status = f"error: {result['error']}" if result["error"] else "done"
            print(f"      {status} in {result['seconds']:.0f} s", file=sys.stderr, flush=True)
    lateness_figures(results)
    report |= {
        "wall_s": time.monotonic() - began,
        "measurements": results,
        "rows": build_rows(results),
        "notes": notes(results),
        "setup": {m.name: m.what for m in chosen},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print()
    print_report(report)
    print(f"JSON: {args.json}; logs: {log_dir}")
    crashed = [name for name, result in results.items() if result["error"] or result["figures"].get("errors")]
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
